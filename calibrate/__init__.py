"""`paraplan calibrate`: microbenchmarks on this machine's GPU (or CPU) with torch, fitted with
scipy to the hardware models' parameters, written as a hardware profile with provenance.

    run          the whole calibration, as `paraplan calibrate` runs it (checks, order, atomic write)
    device       which device, its software stack, and the bundled profile matching its name
    plan         which shapes and sizes to run, scaled to the device's measured speed (no torch)
    bench        single-device kernels: GEMM, HBM copy/triad, attention, elementwise, AdamW
    collectives  nccl-tests-style sweeps over the ranks torchrun started (gloo on a CPU)
    fit          efficiency curves and alpha-beta models, held-out error (numpy/scipy, no torch)
    build        the GpuProfile and its provenance (no torch)
    results      the measurement records; progress the stderr line; errors CalibrationError

Importing this package does not import torch; `bench`, `collectives` and `run.calibrate` do.
"""
