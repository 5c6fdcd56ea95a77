"""Analytic step model: FLOPs, bytes, communication, memory, roofline time (fidelity: estimate).

Every figure here is an estimate from formulas and a datasheet; none is a measurement.
Compile trials reuse it with the compiler's real memory in place of the estimated one.
"""

from __future__ import annotations

from typing import Any

from trainer.spec.capacity import receive_buffer_groups
from trainer.spec.checks import check_static, global_batch_size
from trainer.spec.config import TrialConfig
from trainer.spec.flops import training_flops_by_kind
from trainer.spec.hardware import Accelerator
from trainer.spec.remat import POLICIES, Tensor, placements

BF16, F32 = 2, 4


# Share of a layer's forward FLOPs recomputed in the backward pass, by what a policy saves.
def parameter_count(config: TrialConfig) -> int:
    m = config.model
    attention = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    if m.is_moe:
        mlp = m.num_experts * 3 * m.d_model * m.mlp_dim + m.d_model * m.num_experts
    else:
        mlp = 3 * m.d_model * m.mlp_dim
    return (
        m.num_layers * (attention + mlp + 2 * m.d_model) + 2 * m.vocab_size * m.d_model + m.d_model
    )


def expert_parameter_count(config: TrialConfig) -> int:
    """Parameters of the routed experts (sharded over `expert`, never gathered across it)."""
    m = config.model
    return m.num_layers * m.num_experts * 3 * m.d_model * m.mlp_dim if m.is_moe else 0


def communication_bytes_per_device(
    config: TrialConfig, degrees: dict[str, int], global_batch: int
) -> dict[str, float]:
    """Bytes each device sends per step, by strategy (ring collectives: (n-1)/n of the data)."""
    m = config.model
    params = parameter_count(config)

    def ring(n: int) -> float:
        return (n - 1) / n if n > 1 else 0.0

    shard = degrees["fsdp"] * degrees["context"] * degrees["expert"]
    tokens_local = (
        global_batch
        * config.seq_len
        / (degrees["data"] * degrees["fsdp"] * degrees["expert"] * degrees["context"])
    )
    tensor, expert, context = degrees["tensor"], degrees["expert"], degrees["context"]
    experts = expert_parameter_count(config)
    # What FSDP gathers and scatters per device: dense weights over every sharding axis;
    # a device's own experts (1/expert of them) over fsdp x context only.
    gathered = (params - experts) / tensor * ring(shard) + experts / (tensor * expert) * ring(
        shard // expert
    )
    weights_local = params / tensor
    comm = {
        # weights all-gathered in forward and again in backward; gradients reduce-scattered
        "fsdp_all_gather": 2 * gathered * BF16,
        "fsdp_reduce_scatter": gathered * F32,
        "data_all_reduce": 2 * weights_local / shard * F32 * ring(degrees["data"]),
        # two activation all-reduces per layer forward, two backward
        "tensor_all_reduce": 4 * m.num_layers * tokens_local * m.d_model * BF16 * 2 * ring(tensor),
        "expert_all_to_all": (
            4 * m.num_layers * tokens_local * m.experts_per_token * m.d_model * BF16 * ring(expert)
        )
        if m.is_moe
        else 0.0,
        # keys and values all-gathered forward, their gradients reduce-scattered backward
        "context_kv_all_gather": 2
        * m.num_layers
        * tokens_local
        * 2
        * m.num_kv_heads
        * m.head_dim
        * BF16
        * (context - 1),
    }
    comm["total"] = sum(comm.values())
    return comm


# What the step holds at its peak beyond the parameters, optimizer state, gradients and saved
# activations: the larger of the loss's working set and one layer's backward. Their parts are
# what libtpu 0.0.52 reports live at its peak (XLA's live-range dump) on a 4-layer model at
# tensor 1 and 2, llama3.1-70b 8k and qwen3-235b-a22b 4k (docs/trainer.md); the four constants
# are fitted on every compile recorded by 2026-12-04 (`python -m benchmarks.memory_model --fit`):
# Bytes per layer parameter in its backward: its bf16 weights gathered, the next layer's
# prefetched and its weight gradient, in part.
LAYER_WEIGHT_BYTES: float = 3.46
# Copies of the layer's tensors (named and unnamed: trainer.spec.remat's and the norms'
# outputs and the gated activation) alive at the peak of its backward, its MLP's.
LAYER_ACTIVATION_COPIES: float = 1.62
# An MoE layer's routed rows of d_model (each token's top-k slots) alive at that peak: the
# dispatched input, the combine's operands and their gradients.
ROUTED_COPIES: float = 4.19
# FP8 with the MLP sharded over `tensor`: quantized copies of the MLP's up-projections kept
# beside the bf16 ones (at tensor 1 the compiles show none).
FP8_MLP_COPIES: float = 2.0


def layer_tensor_bytes(
    config: TrialConfig, degrees: dict[str, int], tokens_local: float
) -> dict[str, float]:
    """Bytes per device of each tensor a decoder layer names (trainer.spec.remat.Tensor), for
    one layer: what saving it on device (or offloading it) costs per layer."""
    m, tensor = config.model, degrees["tensor"]
    heads = tokens_local * m.head_dim * BF16 / tensor
    residual = tokens_local * m.d_model * BF16
    sizes = {
        Tensor.DECODER_LAYER_INPUT: residual,
        Tensor.CONTEXT: heads * m.num_heads,
        Tensor.QUERY_PROJ: heads * m.num_heads,
        Tensor.KEY_PROJ: heads * m.num_kv_heads,
        Tensor.VALUE_PROJ: heads * m.num_kv_heads,
        Tensor.QKV_PROJ: heads * (m.num_heads + 2 * m.num_kv_heads) if m.fused_qkv else 0.0,
        Tensor.OUT_PROJ: residual,
    }
    rows = tokens_local
    if m.is_moe:  # routed rows: each token's top-k slots, received into the EP buffer
        slots = tokens_local * m.experts_per_token
        groups = receive_buffer_groups(
            round(slots), m.num_experts, degrees["expert"], m.capacity_factor
        )
        rows = slots * groups
    sizes[Tensor.MLPWI_0] = sizes[Tensor.MLPWI_1] = rows * m.mlp_dim * BF16 / tensor
    # An expert's output row is a partial sum over the tensor shards of the mlp dimension
    # (summed after the combine): every device holds whole d_model rows.
    sizes[Tensor.MLPWO] = rows * m.d_model * BF16 / (1 if m.is_moe else tensor)
    return {t.value: v for t, v in sizes.items()}


def _placed(config: TrialConfig) -> dict[str, tuple[str, ...]]:
    """Tensor names kept on device and offloaded, each once (an MoE twin counts as its tensor;
    the layer input, the checkpoint boundary, is kept unless placed otherwise)."""
    placed = placements(config.remat)
    boundary = Tensor.DECODER_LAYER_INPUT.value
    out: dict[str, tuple[str, ...]] = {}
    for where in ("device", "offload"):
        names = {n.removeprefix("moe_") for n in placed[where]}
        out[where] = tuple(sorted(names))
    if config.remat.policy != "custom":
        out["device"] = tuple(sorted({boundary, *out["device"]}))
    # A dense MLP's output is read only by the residual add whose result is the next layer's
    # input: kept beside that input it holds nothing the backward reads (XLA drops it; the
    # 405B recipe's offloaded mlpwo moved no bytes to host). An MoE layer's is read: the
    # router weights' gradient takes each expert's output (mixtral-8x7b, TP 4, kept on device:
    # 109.6 GiB of temporaries where 89.9 were estimated without it).
    if not config.model.is_moe and boundary in (*out["device"], *out["offload"]):
        out = {k: tuple(n for n in v if n != Tensor.MLPWO.value) for k, v in out.items()}
    return out


def memory_per_device(
    config: TrialConfig, degrees: dict[str, int], global_batch: int
) -> dict[str, float]:
    """Bytes per device at the step's peak: parameters, optimizer state and gradients; the
    activations each layer keeps on device for the backward (per tensor, as the remat policy
    or its custom placements place them; offloaded ones are host bytes); and the working set
    of one layer's backward or of the loss, whichever is larger."""
    m = config.model
    shards = degrees["fsdp"] * degrees["context"] * degrees["expert"] * degrees["tensor"]
    params = parameter_count(config) / shards
    tokens_local = (
        global_batch
        * config.seq_len
        / (degrees["data"] * degrees["fsdp"] * degrees["expert"] * degrees["context"])
    )
    sizes = layer_tensor_bytes(config, degrees, tokens_local)
    placed = _placed(config)
    saved = m.num_layers * sum(sizes[n] for n in placed["device"])
    host = m.num_layers * sum(sizes[n] for n in placed["offload"])
    # One layer's backward (the constants above): its weights gathered over fsdp (a device's
    # own experts only), its tensors, an MoE layer's routed rows, fp8's quantized copies.
    experts = expert_parameter_count(config) / m.num_layers
    layer_params = (
        (parameter_count(config) - 2 * m.vocab_size * m.d_model) / m.num_layers - experts
    ) / degrees["tensor"] + experts / (degrees["tensor"] * degrees["expert"])
    residual = tokens_local * m.d_model * BF16
    unnamed = 2 * residual + sizes[Tensor.MLPWI_0.value]
    if m.is_moe:
        unnamed += sizes[Tensor.MLPWO.value]  # routed rows x d_model, as the MLP's output
    routed = sizes[Tensor.MLPWO.value] if m.is_moe else 0.0
    fp8 = config.precision.mode == "fp8" and degrees["tensor"] > 1
    # The loss: the bf16 logits (one tile when tiled) and, where the vocabulary is not sharded
    # over `tensor`, their gradient (sharded, libtpu fuses it into the gradient matmuls); the
    # gathered bf16 unembedding twice (the forward's and the gradient matmul's copy); the
    # final norm's output and its gradient.
    vocab_whole = degrees["tensor"] == 1
    logits = tokens_local * m.vocab_size / degrees["tensor"] * BF16 / config.vocab_tiling
    unembedding = m.vocab_size * m.d_model / degrees["tensor"] * BF16
    loss = logits * (2 if vocab_whole else 1) + 2 * unembedding + 2 * residual
    layer = (
        LAYER_WEIGHT_BYTES * layer_params
        + LAYER_ACTIVATION_COPIES * (sum(sizes.values()) + unnamed)
        + ROUTED_COPIES * routed
        + FP8_MLP_COPIES * sizes[Tensor.MLPWI_0.value] * fp8
        # the logits, kept until the unembedding's weight gradient, which libtpu runs beside
        # the layers' backward when the vocabulary is whole (qwen3's 18.5 GiB stay live there)
        + logits * vocab_whole
    )
    working = max(layer, loss)
    mu_bytes = BF16 if config.mu_dtype == "bfloat16" else F32
    memory = {
        "params_f32": params * F32,
        "optimizer_state": params * (mu_bytes + F32),
        "gradients_f32": params * F32,
        "activations": saved,
        "working_set": working,
    }
    memory["total"] = sum(memory.values())
    memory["host_activations"] = host  # pinned host memory, not in the device total
    return memory


def recompute_share(config: TrialConfig) -> float:
    """Share of a layer's forward FLOPs the backward recomputes: the policy's figure, or for
    custom placements the matmuls whose outputs it does not keep (attention's core unless
    the context is kept; the projections unless their outputs are)."""
    if config.remat.policy != "custom":
        return POLICIES[config.remat.policy].recompute_share
    m = config.model
    kept = {n.removeprefix("moe_") for where in placements(config.remat).values() for n in where}
    experts = m.experts_per_token if m.is_moe else 1
    flops = {  # per token, forward
        "qkv": 2 * m.d_model * m.head_dim * (m.num_heads + 2 * m.num_kv_heads),
        "attention": 2 * config.seq_len * m.num_heads * m.head_dim,  # causal: half of 4 x seq
        "out": 2 * m.num_heads * m.head_dim * m.d_model,
        "wi": 4 * m.d_model * m.mlp_dim * experts,
        "wo": 2 * m.d_model * m.mlp_dim * experts,
    }
    qkv = {Tensor.QUERY_PROJ.value, Tensor.KEY_PROJ.value, Tensor.VALUE_PROJ.value}
    saved = {
        "qkv": qkv <= kept or Tensor.QKV_PROJ.value in kept,
        "attention": Tensor.CONTEXT.value in kept,
        "out": Tensor.OUT_PROJ.value in kept,
        "wi": {Tensor.MLPWI_0.value, Tensor.MLPWI_1.value} <= kept,
        "wo": Tensor.MLPWO.value in kept,
    }
    return sum(f for k, f in flops.items() if not saved[k]) / sum(flops.values())


def estimate(
    config: TrialConfig, accel: Accelerator, num_devices: int, memory_bytes: float | None = None
) -> dict[str, Any]:
    """Roofline step estimate on `num_devices` devices of `accel`.

    Compute, HBM and ICI overlap, except what a step cannot overlap by its structure: the
    optimizer's update (it reads and writes every parameter, moment and gradient once the
    last gradient is reduced) and, with the weights gathered layer by layer, the first
    layer's gather and the last layer's reduce-scatter (nothing to compute under them). In
    FP8 the layers' projections and FFN run at the FP8 peak; the attention core (Splash, bf16)
    and the logits at the bf16 peak.
    """
    degrees = check_static(config, num_devices)
    global_batch = global_batch_size(config, num_devices)
    chips = num_devices / accel.devices_per_chip
    kinds = training_flops_by_kind(config.model, global_batch, config.seq_len)
    model_flops = sum(kinds.values())
    # The backward recomputes this share of each layer's forward (matmuls and attention alike).
    share = recompute_share(config)
    recompute = (kinds["layer_matmul"] + kinds["attention"]) / 3 * share
    precision = config.precision.peak
    peak = accel.peak_tflops[precision] * 1e12
    fast = kinds["layer_matmul"] * (1 + share / 3) if precision == "fp8" else 0.0
    mem = memory_per_device(config, degrees, global_batch)
    comm = communication_bytes_per_device(config, degrees, global_batch)
    flops_per_chip = (model_flops + recompute) / chips
    update_bytes_per_chip = (
        accel.devices_per_chip
        * 2
        * (mem["params_f32"] + mem["optimizer_state"] + mem["gradients_f32"])
    )
    hbm_bytes_per_chip = update_bytes_per_chip + accel.devices_per_chip * (
        mem["params_f32"] / F32 * BF16 * 3 + 2 * mem["activations"]
    )
    ici_bytes_per_chip = accel.devices_per_chip * comm["total"]
    ici_s = ici_bytes_per_chip / accel.ici_axis_bytes_per_s  # a ring over one torus axis
    edge = (
        2 / config.model.num_layers if degrees["fsdp"] > 1 and config.model.num_layers > 2 else 0.0
    )
    times = {
        "compute": (fast / (accel.peak_tflops.get("fp8", accel.peak_tflops["bf16"]) * 1e12)
                    + (model_flops + recompute - fast) / (accel.peak_tflops["bf16"] * 1e12)) / chips,
        "hbm": hbm_bytes_per_chip / accel.hbm_bytes_per_s,
        "ici": ici_s,
        # offloaded activations go to the host in the forward and come back in the backward
        "host": accel.devices_per_chip * 2 * mem["host_activations"] / accel.host_link_bytes_per_s,
    }  # fmt: skip
    update_s = update_bytes_per_chip / accel.hbm_bytes_per_s
    serial = update_s + ici_s * edge
    overlapped = {**times, "hbm": times["hbm"] - update_s, "ici": ici_s * (1 - edge)}
    step_time = max(overlapped.values()) + serial
    tokens = global_batch * config.seq_len
    used = memory_bytes if memory_bytes is not None else mem["total"]
    return {
        "fidelity": "estimate",
        "hardware": accel.name,
        "chips": chips,
        "model_flops_per_step": model_flops,
        "est_serial_s": serial,
        "recompute_flops_per_step": recompute,
        "est_step_time_s": step_time,
        "est_compute_s": times["compute"],
        "est_hbm_s": times["hbm"],
        "est_ici_s": times["ici"],
        "bound": max(times, key=lambda name: times[name]),
        "est_tokens_per_sec_per_chip": tokens / step_time / chips,
        "est_mfu": model_flops / chips / step_time / peak,
        # Per byte over each of the ring's two links, as the hardware figure is per link:
        # below the hardware's figure exactly when the ICI time exceeds the compute time.
        "arithmetic_intensity_ici": flops_per_chip / (ici_bytes_per_chip / 2)
        if ici_bytes_per_chip
        else float("inf"),
        "hardware_intensity_ici": accel.intensity_flops_per_ici_byte(precision),
        "arithmetic_intensity_hbm": flops_per_chip / hbm_bytes_per_chip,
        "hardware_intensity_hbm": accel.intensity_flops_per_hbm_byte(precision),
        "communication_bytes_per_device": comm,
        "est_memory_per_device": mem,
        "est_host_s": times["host"],
        "fits": used <= accel.usable_hbm_per_device
        and (  # 0: the host's memory is not known for this accelerator, not judged
            not accel.host_offload_per_device
            or mem["host_activations"] <= accel.host_offload_per_device
        ),
        "usable_hbm_per_device": accel.usable_hbm_per_device,
    }
