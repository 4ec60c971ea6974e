"""The shared vocabulary: frozen, keyword-only specs of a model, a cluster, training settings and a plan.

Internal units are SI (seconds, bytes, bytes/s, FLOP/s). YAML keys carry their unit
(`bandwidth_GBps`, `latency_us`); the loader converts. Every spec is hashable so the planner can
memoise on it, and `dataclasses.replace` makes variants.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ACTIVATIONS = ("gelu", "swiglu")
PRECISIONS = ("fp32", "fp16", "bf16", "fp8")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
RECOMPUTE = ("none", "selective", "full")
# What selective recompute re-runs, by Megatron-Core's --recompute-modules names
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe_act", "moe", "shared_experts")
MOE_RECOMPUTE_MODULES = ("moe_act", "moe", "shared_experts")
ZERO_STAGES = (0, 1, 2, 3)
TOPOLOGIES = ("fat-tree", "rail-optimized")
OBJECTIVES = ("throughput", "cost", "throughput-vs-headroom", "throughput-vs-gpus")
"""The planner's objectives (planner.objective.make_objective, paraplan plan --objective)."""

# The physical figures a scenario or a GPU profile may give, in SI units: about a thousand times past
# today's hardware either way (NVLink 5 moves 1.8e12 B/s per GPU, an H100 runs about 1e15 FLOP/s,
# a B200 holds 1.9e11 bytes), so a typo is refused instead of pricing a collective at 1e-300 s or
# giving a GPU unbounded memory.
BANDWIDTH_RANGE = (1e6, 1e15)  # bytes/s (links, NICs, HBM)
BUSBW_RANGE = (1.0, 1e15)  # bytes/s of a measured collective: latency-bound small ones run at kB/s (gloo)
LATENCY_RANGE = (0.0, 1.0)  # seconds
FLOPS_RANGE = (1e9, 1e19)  # FLOP/s
CAPACITY_RANGE = (2.0**20, 2.0**50)  # bytes
OVERSUBSCRIPTION_RANGE = (1.0, 1e3)
EFFICIENCY_FLOOR = 1e-6  # the least efficiency a curve may give (calibrated curves reach 7e-4)
ATTENTION_KERNELS = ("flash", "flash3", "unfused")
GRAD_REDUCE_DTYPES = ("fp32", "bf16", "fp16")

# bytes per element of the compute dtype (weights/activations as the kernels see them)
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


ROUTING_DISTRIBUTIONS = ("uniform", "zipf", "histogram")
MOE_DISPATCHERS = ("alltoall", "deepep")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""Context-parallel attention exchanges, by Transformer Engine's cp_comm_type (Megatron --cp-comm-type)."""


@dataclass(frozen=True, kw_only=True)
class RoutingSpec:
    """How the router spreads tokens over experts (for imbalance): a distribution over experts."""

    distribution: str = "uniform"
    s: float = 1.2
    """Zipf exponent (zipf only): expert i gets a share proportional to 1/(i+1)^s."""
    tokens_per_expert: tuple[float, ...] = ()
    """A measured router histogram (histogram only), one count per expert."""
    seed: int = 0
    """Seed of the generator that places experts on ranks and draws per-rank token counts."""


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """Mixture-of-experts feed-forward layers (Switch/GShard style top-k routing)."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    num_shared_experts: int = 0
    """Always-active experts of the same width (DeepSeek style)."""
    first_dense_layers: int = 0
    """Leading layers with a dense FFN of model.ffn_hidden_size (DeepSeek-V3: 3)."""
    moe_layer_freq: int = 1
    """Every n-th layer (after the dense ones) is MoE; the others dense (Mixtral/Qwen3: 1)."""
    capacity_factor: float | None = None
    """Tokens an expert accepts, as a multiple of the average; None = dropless."""
    expert_groups: int = 1
    """Group-limited routing: the experts form this many equal groups of consecutive experts, and a
    token picks groups_per_token groups before its top_k experts among theirs (DeepSeek-V3's
    node-limited routing, 8 groups, 4 per token: a token reaches at most 4 nodes when each node
    holds one group; Megatron-Core --moe-router-num-groups / --moe-router-group-topk). 1: no limit."""
    groups_per_token: int = 1
    routing: RoutingSpec = field(default_factory=RoutingSpec)

    def is_moe_layer(self, index: int) -> bool:
        if index < self.first_dense_layers:
            return False
        return (index - self.first_dense_layers) % self.moe_layer_freq == 0


NORMALIZATIONS = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("rope", "learned", "alibi", "none")
ROPE_SCALINGS = ("llama3", "yarn", "linear", "dynamic", "longrope")
"""transformers' rope_type names (modeling_rope_utils.ROPE_INIT_FUNCTIONS) other than default."""


@dataclass(frozen=True, kw_only=True)
class ArchitectureSpec:
    """What building the model takes beyond the shapes the simulation needs, as a Hugging Face
    config.json states it: the launch configs' normalization, position embedding and biases
    (planner.model_families). Of it the simulation prices the rotary embedding (rope) and the
    norms' biases (an RMSNorm has none)."""

    normalization: str
    norm_epsilon: float
    position_embedding: str
    rotary_base: float | None = None
    rope_scaling: str | None = None
    """As the config's rope_scaling names it: llama3 (Llama 3.1's frequency scaling), yarn, linear
    (position interpolation), dynamic (NTK) or longrope."""
    rope_scaling_factor: float | None = None
    qkv_bias: bool = False
    """Biases on the query/key/value projection (Qwen2; Megatron --add-qkv-bias)."""
    output_bias: bool = False
    """A bias on the attention's output projection too (Llama's and Qwen3's attention_bias), which
    Megatron-LM has no flag for alone."""


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, Sec. 2.1; Megatron-Core
    MLASelfAttention): queries and keys/values are projected down to low-rank latents, normalised,
    and projected back up per head; a decoupled rotary part of qk_rope_head_dim per head (queries)
    and one shared rotary key per token."""

    q_lora_rank: int | None
    """Query latent width; None projects queries directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int
    qk_head_dim: int
    """Per-head query/key width without the rotary part."""
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer."""

    name: str = "custom"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    """Key/value heads; smaller than num_attention_heads means grouped-query attention."""
    ffn_hidden_size: int
    vocab_size: int
    activation: str = "gelu"
    """gelu (two FFN matrices) or swiglu (three: gate, up, down)."""
    head_dim: int
    """Per-head width; hidden_size // num_attention_heads unless the model says otherwise."""
    tied_embeddings: bool = False
    """Input embedding and LM head share one matrix (Megatron GPT default); costs a first/last-stage all-reduce under PP."""
    dropout: float = 0.1
    """Hidden and attention dropout probability (Megatron --hidden-dropout / --attention-dropout,
    0.1 by default). 0, as the Llama-family, Mixtral, Qwen3, DeepSeek-V3 and MPT recipes train,
    stores no dropout masks and writes none: torch's dropout with p = 0 returns its input
    (aten/src/ATen/native/Dropout.cpp)."""
    linear_bias: bool = False
    """The linear layers have biases (Megatron's default, --add-bias-linear; GPT-2/GPT-3). The
    scenario loader defaults it by activation: true for GELU models, false for SwiGLU ones (the
    Llama family). Priced where a bias's gradient is an extra pass: Megatron fuses the MLP's first
    bias into its GELU and the projections' into the bias-dropout-add, whose backwards return the
    bias gradient at full size for autograd to reduce over the tokens (a read of that gradient).
    The query/key/value bias, whose gradient Transformer Engine folds into its weight-gradient GEMM,
    and the biases' few parameters (under 0.01% of a model's) are not counted."""
    qk_layernorm: bool = False
    """A norm over each attention head's queries and keys before the rotary embedding (Qwen3's
    q_norm / k_norm; Megatron-Core --qk-layernorm builds SelfAttention's q_layernorm and
    k_layernorm). Not with MLA, whose latent norms are part of model.mla."""
    moe: MoESpec | None = None
    """Mixture-of-experts FFN; None for a dense model."""
    mla: MLASpec | None = None
    """Multi-head latent attention instead of multi-head/grouped-query attention (head_dim is then
    its v_head_dim)."""
    mtp_layers: int = 0
    """Multi-token prediction modules (DeepSeek-V3, arXiv 2412.19437, Sec. 2.2; Megatron-Core
    --mtp-num-layers): each embeds the next token, normalises it and the previous hidden state,
    projects their concatenation 2h -> h, runs one more layer of the model's last kind and the
    shared LM head; they run on the last pipeline stage."""
    sliding_window: int | None = None
    """Sliding-window attention's window (Mistral's sliding_window): each token attends to the last
    this many. Not priced: the loader refuses a window shorter than the sequence."""
    architecture: ArchitectureSpec | None = None
    """The normalization, position embedding and biases a config.json gave; None: the activation's
    usual ones (gelu: GPT's LayerNorm and learned positions; swiglu: Llama's RMSNorm and RoPE)."""

    @property
    def normalization(self) -> str:
        return self.architecture.normalization if self.architecture else (
            "layernorm" if self.activation == "gelu" else "rmsnorm")

    @property
    def rotary(self) -> bool:
        """Rotary position embeddings, a kernel over the queries and keys of every layer."""
        return self.architecture.position_embedding == "rope" if self.architecture else self.activation == "swiglu"

    @property
    def q_head_dim(self) -> int:
        """Per-head width of queries and keys (MLA: the non-rotary and rotary parts together)."""
        return self.head_dim if self.mla is None else self.mla.qk_head_dim + self.mla.qk_rope_head_dim

    @property
    def kv_channels(self) -> int:
        """Width of the keys (= of the values) of grouped-query attention."""
        return self.num_kv_heads * self.head_dim

    @property
    def q_channels(self) -> int:
        return self.num_attention_heads * self.q_head_dim

    @property
    def k_channels(self) -> int:
        """Width of the keys attention reads (MLA: every head's, after the up-projection)."""
        return self.kv_channels if self.mla is None else self.q_channels

    @property
    def v_channels(self) -> int:
        """Width of the values attention reads; also the attention output's width per KV group."""
        return self.kv_channels if self.mla is None else self.num_attention_heads * self.mla.v_head_dim

    @property
    def o_channels(self) -> int:
        """Width of the attention output, the output projection's input."""
        return self.num_attention_heads * (self.head_dim if self.mla is None else self.mla.v_head_dim)

    @property
    def ffn_matrices(self) -> int:
        return 3 if self.activation == "swiglu" else 2

    def attention_linears(self) -> list[tuple[int, int, str]]:
        """(input width, output width, tensor-parallel mode) of one layer's attention projections in
        forward order; mode: column (output split over TP), row (input split) or replicated (every
        TP rank runs it whole). Megatron-LM (Shoeybi et al. 2019, Fig. 3): a column-parallel QKV
        and a row-parallel output projection. MLA (Megatron-Core MLASelfAttention): replicated
        ("duplicated") query and key/value down-projections, column-parallel up-projections of the
        latents (keys/values: kv_lora_rank -> heads x (qk_head_dim + v_head_dim)), row-parallel
        output projection."""
        h, a = self.hidden_size, self.mla
        if a is None:
            return [(h, self.q_channels + self.k_channels + self.v_channels, "column"), (self.o_channels, h, "row")]
        query = ([(h, a.q_lora_rank, "replicated"), (a.q_lora_rank, self.q_channels, "column")]
                 if a.q_lora_rank else [(h, self.q_channels, "column")])
        kv_up = self.num_attention_heads * (a.qk_head_dim + a.v_head_dim)
        return [*query, (h, a.kv_lora_rank + a.qk_rope_head_dim, "replicated"), (a.kv_lora_rank, kv_up, "column"),
                (self.o_channels, h, "row")]

    @property
    def latent_channels(self) -> int:
        """MLA's normalised latents per token (query latent and key/value latent; their norms'
        weights), 0 without MLA."""
        return 0 if self.mla is None else (self.mla.q_lora_rank or 0) + self.mla.kv_lora_rank

    def attention_params(self, tp: int = 1) -> float:
        """Attention projections of one layer plus its two norms (and MLA's latent norms), on one of
        `tp` tensor-parallel ranks: split projections divided by tp, replicated ones whole, and the
        norms whole (every tensor-parallel rank keeps its own copy of a norm's weights: Megatron's
        sequence-parallel norms all-reduce their gradients over the TP group)."""
        linears = sum(k * n / (1 if mode == "replicated" else tp) for k, n, mode in self.attention_linears())
        return linears + self.norm_params()

    def router_params(self) -> int:
        """An MoE layer's router: an h x E linear (0 for a dense model)."""
        return 0 if self.moe is None else self.hidden_size * self.moe.num_experts

    def norm_params(self) -> int:
        """One layer's norm weights: its two norms' weights, their biases where the model has biases
        (Megatron's LayerNorm with --add-bias-linear; an RMSNorm has none, nor has MPT's no_bias
        LayerNorm), and MLA's latent norms."""
        return 2 * self.one_norm_params + self.latent_channels

    @property
    def norm_bias(self) -> bool:
        """The norms have biases: a LayerNorm's, where the model has biases (an RMSNorm has none)."""
        return self.linear_bias and self.normalization == "layernorm"

    @property
    def one_norm_params(self) -> int:
        """One h-wide norm's weight, and its bias where it has one (norm_bias)."""
        return (2 if self.norm_bias else 1) * self.hidden_size

    def vocab_shard(self, tp: int) -> int:
        """The largest of `tp` vocabulary-parallel shards, ceil(V/tp): Megatron pads the vocabulary
        to a multiple of 128 x tp (--make-vocab-size-divisible-by) where the scenario has not, so its
        shards are no smaller; DTensor's uneven sharding (torchtitan) gives the first ranks this many."""
        return -(-self.vocab_size // tp)

    def expert_params(self) -> int:
        """One expert FFN (same activation as the model)."""
        assert self.moe is not None
        return self.ffn_matrices * self.hidden_size * self.moe.expert_ffn_hidden_size

    def layer_params(self, index: int = 0) -> int:
        """Weights of layer `index`: attention + a dense FFN, or the router, every routed expert
        and the shared experts when it is an MoE layer."""
        if self.is_moe_layer(index):
            e = self.moe
            return (self.attention_params() + self.router_params()
                    + (e.num_experts + e.num_shared_experts) * self.expert_params())
        return self.attention_params() + self.ffn_matrices * self.hidden_size * self.ffn_hidden_size

    def mtp_projection_params(self) -> int:
        """What a multi-token prediction module adds around its layer: the 2h -> h projection and
        three norms (embedding, hidden, final); its embedding and LM head are the model's."""
        return 2 * self.hidden_size * self.hidden_size + self.mtp_norm_params()

    def mtp_norm_params(self) -> int:
        """A multi-token prediction module's three norms (embedding, hidden, final), h each."""
        return 3 * self.hidden_size

    def mtp_module_params(self) -> int:
        """One multi-token prediction module: a layer like the model's last, and its projection."""
        return self.layer_params(self.num_layers - 1) + self.mtp_projection_params()

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        head = 0 if self.tied_embeddings else self.embedding_params()
        layers = sum(self.layer_params(i) for i in range(self.num_layers))
        mtp = self.mtp_layers * self.mtp_module_params()
        return layers + mtp + self.embedding_params() + head + self.one_norm_params  # and the final norm


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One network tier as the user states it (per GPU, one direction)."""

    bandwidth: float
    """bytes/s per GPU per direction."""
    latency: float
    """seconds per hop of NCCL's LL ring (tuning.cc hwLat: 0.6 us over NVLink); every algorithm's
    and protocol's hop latency scales with it (hwmodels.network.build_network)."""


@dataclass(frozen=True, kw_only=True)
class InterNodeSpec:
    nics_per_node: int
    nic_bandwidth: float
    """bytes/s per NIC per direction (the YAML gives nic_bandwidth_Gbps, bits)."""
    topology: str = "rail-optimized"
    oversubscription: float = 1.0
    """Leaf-to-spine oversubscription: a leaf's uplinks carry 1/this of its NICs' bandwidth, so
    traffic that crosses the spine slows by max(1, this x the share of the leaf's traffic that
    crosses; hwmodels.network._spine_share)."""
    latency: float = 2.7e-6
    """seconds per network hop of NCCL's LL ring (tuning.cc hwLat, the bundled profiles' figure);
    every algorithm's and protocol's network hop latency scales with it."""
    nodes_per_leaf: int = 32
    """Nodes under one leaf (rail) switch: a group inside it never crosses the spine."""

    @property
    def leaf_ports(self) -> int:
        """A leaf switch's ports down to the nodes. Rail-optimized: NIC i of each node goes to
        rail i's leaf, one port a node (DGX SuperPOD: a 64-port NDR leaf serves its rail of a 32-node
        scalable unit, 32 ports up; the A100 SuperPOD's 40-port HDR leaves serve 20 nodes); fat tree:
        every NIC of a node goes to the same leaf, nics_per_node ports a node (NVIDIA's AI factory
        reference architecture names both, https://docs.nvidia.com/enterprise-reference-architectures/hgx-ai-factory-h100-h200-b200/latest/networking-physical-topologies.html)."""
        return self.nodes_per_leaf * (1 if self.topology == "rail-optimized" else self.nics_per_node)

    def nodes_under_leaf(self, ports: int) -> int:
        """How many of this fabric's nodes a leaf of `ports` down ports holds (see leaf_ports)."""
        return ports if self.topology == "rail-optimized" else max(1, ports // self.nics_per_node)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    gpu: str
    """Bundled profile name or a path to a profile file."""
    num_nodes: int
    gpus_per_node: int
    intra_node: LinkSpec | None = None
    """None: defaults from the GPU profile's NVLink generation."""
    inter_node: InterNodeSpec | None = None
    """None: defaults from the GPU profile's typical node."""

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def shape(self) -> str:
        """'N nodes x G', as messages and exports print the cluster."""
        return nodes_x_gpus(self.num_nodes, self.gpus_per_node)


def nodes_x_gpus(num_nodes: int, gpus_per_node: int) -> str:
    """'1 node x 8', '4 nodes x 8'."""
    return f"{num_nodes} node{'s' if num_nodes != 1 else ''} x {gpus_per_node}"


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    seq_length: int
    global_batch_size: int
    precision: str = "bf16"
    attention: str = "flash"
    """Attention kernel: flash (fused, FlashAttention-2 style) or unfused (QK^T, softmax, AV as separate kernels; Megatron before 2023)."""
    optimizer: str = "adam"
    """What the executor builds (executor.optim: adam/adamw, or sgd for its equivalence tests); no
    scenario key sets it, and the simulator prices Adam's states and step."""
    grad_reduce_dtype: str = "fp32"
    """The dtype gradients are accumulated in across microbatches and reduced in over data
    parallelism: fp32 (Megatron's default under bf16, accumulate_allreduce_grads_in_fp32; FSDP and
    torchtitan's reduce_dtype default) or the 16-bit training dtype (Megatron --grad-reduce-in-bf16,
    Megatron under fp16 without --accumulate-allreduce-grads-in-fp32, FSDP MixedPrecision
    reduce_dtype bf16 as Composer's PURE mode sets it, DeepSpeed fp16)."""


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert parallelism (Megatron-Core MoE parallel folding): the expert layers re-divide a
    stage's tp x cp x dp ranks into expert_tp x ep x expert-data-parallel, so ep x expert_tp
    divides tp x cp x dp."""
    expert_tp: int = 1
    """Tensor parallelism inside each expert (Megatron --expert-tensor-parallel-size)."""
    moe_shared_expert_overlap: bool = False
    """Run the shared experts while the tokens are dispatched (Megatron --moe-shared-expert-overlap)."""
    overlap_moe_expert_parallel_comm: bool = False
    """Combined 1F1B (Megatron-Core --overlap-moe-expert-parallel-comm): each steady-state forward
    runs merged with the backward of an earlier microbatch, layer by layer on two CUDA streams, so
    one's dispatch/combine all-to-alls hide behind the other's attention and expert compute; one
    more microbatch is in flight (the interleaved warm-up takes one forward more; with pp 1 the
    forward of microbatch i + 1 runs with the backward of i). Under the dualpipev schedule: its
    forward/backward pairs overlap the same way (DeepSeek's DualPipe) instead of running one after
    the other."""
    moe_dispatcher: str = "alltoall"
    """alltoall: NCCL all-to-all-v of every token copy (Megatron --moe-token-dispatcher-type alltoall);
    deepep: DeepEP's kernels, which send a token over the network once per destination node and fan
    it out to that node's experts over NVLink (Megatron flex dispatcher with DeepEP)."""
    cp_comm_type: str = "p2p"
    """How context parallelism exchanges keys and values (Megatron --cp-comm-type, Transformer
    Engine's cp_comm_type; simulator.workload prices each): p2p passes each rank's K and V round a
    ring, one step per rank, hidden behind that step's attention (ring attention, Megatron's
    default); all_gather gathers the whole sequence's K and V before the attention and
    reduce-scatters their gradients, exposed (Llama 3, Dubey et al. 2024 Sec. 3.3.2); a2a trades
    the sequence split for a head split with all-to-alls of Q, K, V and the output, exposed
    (DeepSpeed-Ulysses, Jacobs et al. 2023), which needs the heads of a TP rank divisible by cp;
    a2a+p2p runs a2a inside groups of cp_a2a_size CP ranks and the ring across them (hierarchical
    CP, Transformer Engine's a2a+p2p)."""
    cp_a2a_size: int | None = None
    """cp_comm_type a2a+p2p: how many CP ranks exchange heads by all-to-all (Megatron
    --hierarchical-context-parallel-sizes A cp/A; the ring runs over cp/A groups). None: the largest
    divisor of cp whose group stays in a node and splits each TP rank's heads
    (paraplan.placement.cp_split)."""
    micro_batch_size: int = 1
    virtual_pipeline_stages: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    zero_stage: int = 0
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """What selective recompute re-runs in the backward (Megatron-Core --recompute-modules):
    core_attn (the attention core), layernorm (the norms), mlp (a dense layer's MLP), moe_act (the
    routed experts' activation function), moe (the whole MoE layer), shared_experts. Used only
    with recompute = selective."""
    overlap_grad_reduce: bool = True
    """Bucketed gradient reduction overlapped with backward (Megatron --overlap-grad-reduce, DDP, FSDP)."""
    overlap_param_gather: bool = False
    """ZeRO-1/2: the post-optimizer parameter all-gather runs bucket by bucket during the next
    forward, whose first pass over each chunk waits for the bucket it needs (Megatron --overlap-param-gather)."""
    tp_comm_overlap: bool = False
    """Overlap TP all-gather/reduce-scatter with the adjacent GEMMs (Megatron --tp-comm-overlap,
    Transformer Engine userbuffers); needs sequence parallelism."""
    tp_backward_overlap: bool = True
    """Backward TP collectives run asynchronously beside GEMMs (Megatron's default; Transformer
    Engine's Linear alike): a column-parallel layer's input-gradient reduce-scatter (all-reduce
    without sequence parallelism, TransformerConfig.async_tensor_model_parallel_allreduce) beside
    its weight-gradient GEMM, and under sequence parallelism the re-gather of its input beside its
    input-gradient GEMM. false: every backward TP collective is exposed (Megatron-LM before the
    asynchronous all-reduce, and the Megatron-DeepSpeed forks of that code)."""
    gradient_accumulation_fusion: bool | None = None
    """Weight-gradient GEMMs accumulate straight into the main gradients (Megatron
    --gradient-accumulation-fusion); off (--no-gradient-accumulation-fusion), a separate kernel adds
    each microbatch's 16-bit gradient in. None: Megatron's default for the plan, see
    fused_grad_accumulation."""
    p2p_scatter_gather: bool = False
    """Without sequence parallelism, each TP rank sends only its 1/tp slice of a pipeline
    activation and the receivers all-gather it over NVLink (Megatron-LM's
    --scatter-gather-tensors-in-pipeline, SC'21 Sec. 4.1, on by default until Megatron-Core;
    DeepSpeed's pipeline engine partitions the same way). false, as Megatron-Core runs: every TP
    rank sends the whole activation (p2p_communication get_tensor_shapes divides the sequence by tp
    only under sequence parallelism)."""
    wait_forward_sends: bool | None = None
    """Under interleaved 1F1B, each stage waits for a forward activation's send to complete before
    its next op, as Megatron-Core does since PR #4047 (2026-04: it waits before freeing the sent
    buffer); false: it goes on at once (Megatron-Core before that, PyTorch's interleaved schedules,
    which wait for their sends at the end of the step). None: true. The other schedules wait as
    their frameworks always have (blocking_sends)."""
    first_stage_layers: int | None = None
    """Layers on the first (virtual) pipeline stage when it differs (Megatron --decoder-first-pipeline-num-layers)."""
    last_stage_layers: int | None = None
    """Layers on the last (virtual) pipeline stage when it differs (Megatron --decoder-last-pipeline-num-layers)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def fused_grad_accumulation(self) -> bool:
        """Whether weight gradients accumulate inside their GEMMs: as set, else on, except under
        ZeRO-2/3, which Megatron runs as Megatron-FSDP, whose user guide requires
        --no-gradient-accumulation-fusion (docs/discussions/megatron-fsdp-user-guide)."""
        if self.gradient_accumulation_fusion is not None:
            return self.gradient_accumulation_fusion
        return self.zero_stage < 2

    @property
    def blocking_sends(self) -> str:
        """Which pipeline sends a stage waits for before its next op (engine.run_iteration): all
        under plain 1F1B (Megatron's forward_backward_pipelining_without_interleaving refuses
        overlap_p2p_comm and waits on each batch_isend_irecv, DeepSpeed's pipeline engine sends
        blocking; PyTorch's Schedule1F1B waits on its steady-state sends, batched with the next
        receive, but on a warm-up forward's send only after the next forward); forward under
        interleaved 1F1B unless wait_forward_sends is false (Megatron-Core's pp_post_forward waits
        for send_next before deallocating the output); none under GPipe, zero-bubble, zbv and dualpipev,
        which PyTorch's schedules run with their forward sends waited before the backward (GPipe)
        or at the end of the step."""
        if self.schedule == "1f1b":
            return "all"
        if self.schedule == "interleaved-1f1b" and self.wait_forward_sends is not False:
            return "forward"
        return "none"

    @property
    def recomputed_modules(self) -> tuple[str, ...]:
        """The modules selective recompute re-runs; () under none or full (which re-runs the layer)."""
        return self.recompute_modules if self.recompute == "selective" else ()

    @property
    def recompute_label(self) -> str:
        """The recompute mode as printed: selective names its modules when they are not the default."""
        if self.recomputed_modules not in ((), ("core_attn",)):
            return f"selective({','.join(self.recompute_modules)})"
        return self.recompute


BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """How the bundled executor runs a plan (`paraplan launch`); ignored by the simulator."""

    steps: int = 10
    """Measured training steps."""
    warmup_steps: int = 2
    """Steps run first and left out of the measurement."""
    seed: int = 0
    backend: str = "nccl"
    """nccl on GPUs, gloo on CPUs."""
    timeout_s: float = 120.0
    """Process-group timeout: a dead rank ends the job after this long instead of hanging."""
    num_layers: int | None = None
    """Run a scaled-down copy of the model with this many layers (None: the model's own)."""
    hidden_size: int | None = None
    """Scaled-down hidden size (heads keep their head_dim; ffn and kv scale with it)."""


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    plan: PlanSpec
    search: tuple = field(default=())
    """The planner's search section (knob -> candidates), kept opaque here."""
    run: RunSpec = field(default_factory=RunSpec)
    """Executor settings (the `run:` section of an executor config)."""

    @property
    def num_microbatches(self) -> int:
        """Microbatches per pipeline per iteration (gradient accumulation steps)."""
        return self.training.global_batch_size // (self.plan.dp * self.plan.micro_batch_size)
