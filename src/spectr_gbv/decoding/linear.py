"""The linear layers a model can run its torch.nn.Linear layers on instead (a model's `quantize` and
`linear_kernel`): int8 weights (Int8Linear), int8 weights and activations (DynamicInt8Linear), or float32 on oneDNN
(OneDNNLinear); check_linear_layers is the one check of those settings, with_linear_layers swaps them in."""
import warnings

import torch
import transformers

from spectr_gbv.errors import ConfigError

QUANTIZE = {None: "the weights as loaded", "int8": "int8 linear weights, one scale per output channel (CPU)",
            "int8_dynamic": "int8 linear weights and int8 activations, one scale per position (x86 CPU, float32)"}
LINEAR_KERNELS = {None: "torch's own matmul", "onednn": "oneDNN with each weight reordered once (CPU, float32)"}


def check_linear_layers(prefix: str, quantize: str | None, linear_kernel: str | None, dtype: str, device: str) -> None:
    """The one check of the quantize and linear_kernel settings (the run's config check calls it with the model's
    key as prefix, "model." or "drafter.")."""
    if quantize not in QUANTIZE:
        raise ConfigError(f"{prefix}quantize", quantize, "choose null (the weights as loaded), int8 or int8_dynamic")
    if linear_kernel not in LINEAR_KERNELS:
        raise ConfigError(f"{prefix}linear_kernel", linear_kernel, "choose null (torch's own matmul) or onednn")
    on_cpu, float32 = device == "cpu", dtype == "float32"
    needs = {  # what each setting needs, by its key and value
        ("quantize", "int8"): {"device cpu": on_cpu, "dtype float32 or bfloat16": float32 or dtype == "bfloat16"},
        ("quantize", "int8_dynamic"): {
            "device cpu": on_cpu, "dtype float32": float32,
            "torch's x86 quantized engine (fbgemm)": torch.backends.quantized.engine in ("x86", "fbgemm")},
        ("linear_kernel", "onednn"): {"device cpu": on_cpu, "dtype float32": float32, "quantize null": quantize is None,
                                      "a torch built with oneDNN": torch.backends.mkldnn.is_available()},
    }
    chosen = {"quantize": quantize, "linear_kernel": linear_kernel}
    for (key, value), met in needs.items():
        unmet = [need for need, ok in met.items() if not ok]
        if chosen[key] == value and unmet:
            here = f"device {device}, dtype {dtype}, quantize {quantize or 'null'}"
            raise ConfigError(f"{prefix}{key}", value, f"needs {', '.join(unmet)} (here {here}); use null")


def int8_scales(weight: torch.Tensor) -> torch.Tensor:
    """One scale per output channel that maps its largest weight to +-127 (never 0: an all-zero row stays zero)."""
    return weight.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127


class Int8Linear(torch.nn.Module):
    """A linear layer whose weight is stored in int8 with one scale per output channel, computed by torch's CPU
    weight-only kernel with activations in the model's dtype. On a CPU a drafter's step of a few positions reads its
    weights once and little else, so half the bytes of bfloat16 make the step cheaper. The model's laws move a little;
    verification stays lossless, because the verifiers get exactly the laws the quantized drafter sampled from."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = int8_scales(weight)
        self.register_buffer("weight", (weight / scales[:, None]).round().to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight, self.scales)
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class OneDNNLinear(torch.nn.Module):
    """A float32 linear layer computed by oneDNN from a weight reordered once into oneDNN's layout (the op torch's
    compiler uses for packed CPU linears). torch's own float32 matmul on a CPU is MKL's sgemm, which on some CPUs is
    slow for the few rows of a decoding step, where a weight reordered once for oneDNN is not (docs/performance.md).
    The same float32 math, summed in another order."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")


class DynamicInt8Linear(torch.nn.Module):
    """A float32 linear layer computed in int8 by torch's x86 kernel (fbgemm): the weight stored in int8 with one
    scale per output channel, each position's activations scaled to int8 at run time, products summed in int32: for
    CPUs where a float32 drafter step is slow even on oneDNN (docs/performance.md). The kernel
    scales its whole input by one range; dividing each position by its largest magnitude, and appending a row that
    spans [-1, 1], fixes that range, so each position gets its own scale and its outputs do not depend on the other
    positions in the pass (batch invariance, README: Engine). The laws move more than with int8 weights alone;
    verification stays lossless, as for Int8Linear."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = int8_scales(weight).double()
        with warnings.catch_warnings():  # torch deprecates quantized tensors; 2.13's x86 kernel still packs from one
            warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quantize_per_channel")
            quantized = torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long), 0,
                                                   torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight, [out, in] (what callers read of a linear layer: its shape, dtype and device)."""
        return torch.ops.quantized.linear_unpack(self.packed)[0].int_repr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        magnitude = rows.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        span = rows.new_zeros(1, rows.shape[1])
        span[0, 0], span[0, 1] = 1.0, -1.0
        # reduce_range: 7-bit activations, as torch's own dynamic linear, so that AVX2's paired u8 x s8 sums fit int16
        y = torch.ops.quantized.linear_dynamic(torch.cat([rows / magnitude, span]), self.packed, True)[:-1] * magnitude
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def with_linear_layers(model: transformers.PreTrainedModel, quantize: str | None,
                       linear_kernel: str | None) -> transformers.PreTrainedModel:
    """The model with every torch.nn.Linear (the output layer included) replaced as `quantize` or `linear_kernel`
    says (check_linear_layers allows at most one of them)."""
    layer = {"int8": Int8Linear, "int8_dynamic": DynamicInt8Linear}.get(quantize)
    layer = OneDNNLinear if linear_kernel == "onednn" else layer
    if layer is not None:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(module, name, layer(child))
    return model
