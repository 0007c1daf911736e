#!/usr/bin/env python3
"""Generate PyTorch reference cases for dos's AdamW, in the `adam-case/v1` schema.

Each case is one safetensors file (`<name>.safetensors`) holding the initial fp32
master parameters, optional warm-start optimizer state, the gradient handed to the
optimizer at every call, and PyTorch's state after the calls (see ADAM_CASES.md in
the shared folder for the schema; tensor names and metadata keys follow it exactly).

The expected values come from torch.optim.AdamW (mode `adamw`) or torch.optim.Adam
(mode `adam`, L2 weight decay), run on the CPU in fp32 with foreach=False and
fused=False, i.e. PyTorch's single-tensor reference implementation. For every call t:

  * the stored gradient `grad.t` (float32, bfloat16 or float16, multiplied by the
    loss scale S when `grad_scale` is set) is upcast exactly to fp32 and divided by S;
  * if any value is then non-finite, the call is skipped: `expected.skipped.t` is
    written and optimizer.step() is NOT called, so the step counter does not advance;
  * otherwise p.grad is set and optimizer.step() runs, and `expected.param.t`,
    `expected.exp_avg.t`, `expected.exp_avg_sq.t` (and `expected.max_exp_avg_sq.t`,
    `expected.param_bf16.t`, `expected.param_fp16.t` where the case asks for them)
    are recorded after the call: every call for short cases, every `save_every`
    calls (and always the last) for long ones.

Every case uses its own fixed seed, and the metadata is written in a fixed order,
so the files are byte-for-byte reproducible for a given PyTorch version. Each file
is read back after writing. As a self-check, each case is also recomputed in
float64 from the stored inputs, once with exact constants (f64_err) and once with
the per-step constants rounded to fp32 as PyTorch's kernels round them
(f64_err_fp32_scalars); the largest relative difference under the schema's metric
(ignoring exp_avg_sq values in the fp32 denormal range) is printed. Over the
schema's 7e-6 is noted (expected for the 1000-step cases); over 1e-4 for both
means this script is wrong, and the exit status is 1.

PyTorch is not installed on the development machines; run this on the GPU machine,
whose python3 has torch and safetensors (the GPU itself is not used):

    python3 scripts/gen_adam_cases.py --out testdata/adam-cases

It prints one line per case written (name, n, steps, final_step, float64 check) and
a last line with the torch version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import struct
import sys
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

FORMAT = "adam-case/v1"
F64_TOLERANCE = 7e-6  # the schema's bound for a float64 recomputation
BUG_TOLERANCE = 1e-4  # a difference this large means this script is wrong
FLT_MIN = 2.0**-126  # smallest normal fp32

GRAD_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
COPY_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Case:
    """One reference case. Defaults are PyTorch's AdamW defaults except weight_decay."""

    name: str
    n: int
    steps: int
    description: str
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    mode: str = "adamw"  # "adamw" (decoupled) or "adam" (L2)
    amsgrad: bool = False
    maximize: bool = False
    step0: int = 0  # > 0: warm start from random state with this step counter
    grad_dtype: str = "float32"
    grad_scale: float | None = None  # loss scale S (a power of two), or None
    # Parameters: randn * param_scale ("normal"), or magnitudes spread over many
    # decades with random signs ("logspread": param_scale * 10**U(-15, 1)).
    param_kind: str = "normal"
    param_scale: float = 1.0
    # "f16" or "extreme": lead the params with values on the 16-bit rounding edges,
    # whose gradients are always zero (see _special_params).
    special_params: str = ""
    # Gradient scale per call: grad_scales[(t-1) % len] when given, else
    # grad_base * 10**U(-grad_span, grad_span) drawn per call.
    grad_scales: tuple[float, ...] | None = None
    grad_base: float = 1e-2
    grad_span: float = 1.0
    zero_at: tuple[tuple[int, float], ...] = ()  # (t, fraction of grad set to 0)
    bad_at: tuple[tuple[int, str], ...] = ()  # (t, "overflow" | "inf" | "-inf" | "nan")
    copies: tuple[str, ...] = ()  # subset of ("bf16", "fp16")
    save_every: int = 1

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())


def _cases() -> list[Case]:
    return [
        Case("plain", 4096, 5, "defaults, fp32 grads", copies=("bf16",)),
        Case("odd_1", 1, 4, "a single element", copies=("fp16",)),
        Case("odd_7", 7, 5, "shorter than any vector width", copies=("bf16", "fp16")),
        Case("odd_1037", 1037, 5, "odd length, not a multiple of 8 or 16", weight_decay=0.01, copies=("fp16",)),
        Case("odd_65537", 65537, 2, "2^16+1 elements", weight_decay=0.01),
        Case("wd_adamw", 2048, 6, "decoupled weight decay", lr=1e-2, weight_decay=0.1, copies=("bf16",)),
        Case("wd_l2_adam", 1001, 6, "torch.optim.Adam, L2 weight decay", mode="adam", lr=1e-2, weight_decay=0.05,
             copies=("fp16",)),
        # Shrinking gradient scales make max_exp_avg_sq run ahead of exp_avg_sq.
        Case("amsgrad_wd", 777, 8, "amsgrad with decoupled weight decay", weight_decay=0.01, amsgrad=True,
             grad_scales=(3e-2, 1e-2, 3e-3, 5e-2, 1e-3, 1e-3, 2e-2, 1e-4), copies=("bf16",)),
        Case("maximize", 513, 4, "maximize with weight decay", weight_decay=0.02, maximize=True, copies=("fp16",)),
        Case("combo_l2_amsgrad_maximize", 333, 6, "Adam L2 + amsgrad + maximize, bf16 grads", mode="adam",
             weight_decay=0.05, amsgrad=True, maximize=True, grad_dtype="bfloat16",
             grad_scales=(1e-1, 1e-2, 3e-2, 1e-3, 5e-2, 1e-4), copies=("bf16", "fp16")),
        Case("bf16_grads", 2053, 5, "bf16 gradients", grad_dtype="bfloat16", copies=("bf16",)),
        Case("fp16_grads", 1500, 5, "fp16 gradients (some fp16-subnormal)", grad_dtype="float16", grad_base=1e-3,
             copies=("fp16",)),
        Case("fp16_scaled", 1500, 6, "fp16 grads, loss scale 65536; call 3 overflows and is skipped",
             grad_dtype="float16", grad_scale=65536.0, grad_base=1e-3, grad_span=0.5, bad_at=((3, "overflow"),),
             copies=("fp16",)),
        Case("bf16_scaled", 1029, 6, "bf16 grads, loss scale 1024; calls 1 (nan) and 6, the last (-inf), skipped",
             grad_dtype="bfloat16", grad_scale=1024.0, weight_decay=0.01, bad_at=((1, "nan"), (6, "-inf")),
             copies=("bf16",)),
        Case("warm", 777, 5, "warm start at step 3", step0=3, weight_decay=0.01, copies=("bf16", "fp16")),
        Case("warm_amsgrad", 555, 4, "warm start at step 10 with max_exp_avg_sq", step0=10, amsgrad=True,
             weight_decay=0.01, copies=("bf16",)),
        # exp_avg_sq = (1-beta2)*g^2 is fp32-denormal for g <~ 1e-18; 1e-30 underflows g^2.
        Case("tiny", 300, 6, "params ~1e-20, grads 1e-17..1e-30: denormal exp_avg_sq", param_scale=1e-20,
             grad_scales=(1e-19, 1e-20, 1e-17, 1e-30, 1e-21, 1e-18), copies=("bf16",)),
        Case("huge", 64, 5, "params ~1e30, grads ~1e15 (grad^2 ~1e30); fp16 copy overflows to inf",
             param_scale=1e30, grad_base=1e15, grad_span=0.3, weight_decay=0.1, copies=("bf16", "fp16")),
        Case("f16_range", 2000, 3, "16-bit rounding edges (frozen by zero grads), then params over 16 decades",
             param_kind="logspread", param_scale=1e6, special_params="f16", copies=("bf16", "fp16")),
        Case("extreme_edges", 32, 2, "fp32 extremes for the 16-bit roundings: FLT_MAX, bf16 max, denormals",
             special_params="extreme", copies=("bf16", "fp16")),
        Case("long", 64, 1000, "1000 calls, state kept every 250", grad_span=0.5, save_every=250,
             copies=("bf16",)),
        # Over 1000 calls the fp32 rounding of the decay factor 1-lr*wd alone moves the
        # params by ~2e-5 relative (over the 1e-5 tolerance): this case passes only
        # with the factor rounded to fp32 as PyTorch does.
        Case("long_wd", 16, 1000, "1000 calls with decoupled weight decay, state kept every 250",
             weight_decay=0.01, save_every=250, copies=("fp16",)),
        Case("betas", 129, 4, "non-default betas and eps", lr=3e-4, beta1=0.8, beta2=0.95, eps=1e-6,
             copies=("fp16",)),
        Case("beta1_zero", 200, 4, "beta1 = 0 (exp_avg is the gradient)", beta1=0.0, weight_decay=0.01,
             copies=("bf16",)),
        Case("zero_grads", 1200, 6, "zero gradients: part of call 1, all of calls 3 and 5, half of call 4",
             weight_decay=0.01, zero_at=((1, 0.25), (3, 1.0), (4, 0.5), (5, 1.0)), copies=("bf16", "fp16")),
    ]


# --------------------------------------------------------------------------- inputs


def _f32_from_bits(bits: list[int]) -> torch.Tensor:
    """fp32 values from their bit patterns (sign bit clear)."""
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


def _ties(gen: torch.Generator, count: int, low_bits: int, exponents: tuple[int, int]) -> torch.Tensor:
    """Random fp32 values exactly halfway between two neighbours with low_bits fewer
    mantissa bits (16: bfloat16, 13: float16), biased exponents in [lo, hi), random signs."""
    exponent = torch.randint(exponents[0], exponents[1], (count,), generator=gen, dtype=torch.int32)
    mantissa = torch.randint(0, 1 << (23 - low_bits), (count,), generator=gen, dtype=torch.int32) << low_bits
    values = ((exponent << 23) | mantissa | (1 << (low_bits - 1))).view(torch.float32)
    sign = torch.where(torch.rand(count, generator=gen) < 0.5, -1.0, 1.0)
    return values * sign


def _special_params(kind: str, gen: torch.Generator) -> torch.Tensor:
    """Parameters on the edges of the fp32 -> 16-bit roundings (they get zero gradients,
    so with weight_decay 0 they stay exactly as they are)."""
    if kind == "f16":
        values = [
            65504.0, 65519.99609375, 65520.0, -65520.0, 65536.0, -1e6,  # fp16 max, overflow edge
            1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2049.0, 2051.0,  # fp16 ties to even
            2**-24, 2**-25, -(2**-25), 3 * 2**-25, 5 * 2**-25, 2**-26,  # fp16 subnormal ties, underflow
            2**-14, 2**-14 - 2**-25, 2**-14 - 2**-24, 1e-9,  # fp16 min normal, neighbours
            1 + 2**-8, 1 + 3 * 2**-8, 257.0, 259.0, -259.0,  # bf16 ties to even
        ]
        return torch.cat([
            torch.tensor(values, dtype=torch.float32),
            _ties(gen, 16, 13, (113, 142)),  # fp16 normal range
            _ties(gen, 16, 16, (110, 147)),  # up to 1e6
        ])
    if kind == "extreme":
        head = _f32_from_bits([
            0x7F7FFFFF,  # FLT_MAX: bf16 rounds up to inf
            0x7F7F0000,  # bf16 max
            0x7F7F8000,  # halfway between bf16 max and inf: inf (even)
            0x7F7E8000,  # tie below bf16 max: 0x7F7E (even)
            0x7F7F7FFF,  # just under the halfway point: bf16 max
            0x00800000,  # FLT_MIN
            0x00000001,  # smallest fp32 denormal: bf16 0
            0x00008000,  # denormal tie: bf16 0 (even)
            0x00018000,  # denormal tie: bf16 0x0002 (even)
            0x0000C000,  # denormal above the tie: bf16 0x0001
            0x007FFFFF,  # largest denormal: rounds up to FLT_MIN in bf16
            0x00400000,  # a denormal that bf16 holds exactly
        ])
        return torch.cat([head, -head[:6], -head[6:]])
    raise ValueError(f"unknown special_params {kind!r}")


def _initial_params(case: Case, gen: torch.Generator) -> torch.Tensor:
    head = _special_params(case.special_params, gen) if case.special_params else torch.empty(0)
    n = case.n - head.numel()
    if n < 0:
        raise ValueError(f"{case.name}: n={case.n} is smaller than its {head.numel()} special params")
    if case.param_kind == "normal":
        rest = torch.randn(n, generator=gen) * case.param_scale
    elif case.param_kind == "logspread":
        exponent = torch.rand(n, generator=gen, dtype=torch.float64) * 16.0 - 15.0
        sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
        rest = (sign * case.param_scale * torch.pow(10.0, exponent)).float()
    else:
        raise ValueError(f"{case.name}: unknown param_kind {case.param_kind!r}")
    return torch.cat([head, rest])


def _frozen(case: Case) -> int:
    """How many leading elements are special params, which always get zero gradients."""
    return _special_params(case.special_params, torch.Generator()).numel() if case.special_params else 0


def _grad_scale_at(case: Case, t: int, gen: torch.Generator) -> float:
    if case.grad_scales is not None:
        return case.grad_scales[(t - 1) % len(case.grad_scales)]
    u = torch.rand(1, generator=gen, dtype=torch.float64).item()
    return case.grad_base * 10.0 ** (case.grad_span * (2.0 * u - 1.0))


def _true_grad(case: Case, t: int, gen: torch.Generator) -> torch.Tensor:
    """The fp32 gradient for call t, before the loss scale and the 16-bit cast."""
    scale = _grad_scale_at(case, t, gen)
    n = case.n
    kind = t % 3
    if kind == 1:  # normal
        g = torch.randn(n, generator=gen)
    elif kind == 2:  # uniform, unit variance
        g = (torch.rand(n, generator=gen) * 2.0 - 1.0) * math.sqrt(3.0)
    else:  # heavy-tailed, with an offset
        g = torch.randn(n, generator=gen) * torch.exp(0.75 * torch.randn(n, generator=gen)) + 0.25
    g = g * scale
    g[:_frozen(case)] = 0.0
    for zt, fraction in case.zero_at:
        if zt == t:
            mask = torch.rand(n, generator=gen) < fraction if fraction < 1.0 else torch.ones(n, dtype=torch.bool)
            g = torch.where(mask, torch.zeros_like(g), g)
    return g


def _bad_indices(case: Case, gen: torch.Generator) -> torch.Tensor:
    k = min(3, case.n)
    return torch.randperm(case.n, generator=gen)[:k]


def _stored_grad(case: Case, t: int, gen: torch.Generator) -> torch.Tensor:
    """grad.t as stored in the file: the gradient times S, cast to grad_dtype."""
    g = _true_grad(case, t, gen)
    scale = case.grad_scale if case.grad_scale is not None else 1.0
    bad = dict(case.bad_at).get(t)
    if bad == "overflow":
        # A real overflow: finite in fp32, but S*g is past fp16's largest value.
        if case.grad_dtype != "float16":
            raise ValueError(f"{case.name}: 'overflow' needs float16 gradients")
        g[_bad_indices(case, gen)] = 4.0 * 65504.0 / scale
    scaled = (g * scale).to(GRAD_DTYPES[case.grad_dtype])
    if bad in ("inf", "-inf", "nan"):
        scaled[_bad_indices(case, gen)] = float(bad)
    return scaled


def _as_fp32_grad(case: Case, stored: torch.Tensor) -> torch.Tensor:
    """What the optimizer gets: an exact upcast, then division by S."""
    g = stored.to(torch.float32)
    if case.grad_scale is not None:
        g = g / case.grad_scale
    return g


def _warm_state(case: Case, gen: torch.Generator) -> dict[str, torch.Tensor]:
    n, base = case.n, case.grad_base
    state = {
        "exp_avg": torch.randn(n, generator=gen) * (0.5 * base),
        "exp_avg_sq": (torch.rand(n, generator=gen) * 0.9 + 0.1) * (base * base),
    }
    if case.amsgrad:
        # A running maximum: at least exp_avg_sq, equal to it for about 30% of the elements.
        bump = torch.rand(n, generator=gen) * (torch.rand(n, generator=gen) > 0.3)
        state["max_exp_avg_sq"] = state["exp_avg_sq"] * (1.0 + bump)
    return state


# --------------------------------------------------------------------------- running


def _make_optimizer(case: Case, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[case.mode]
    return cls(
        [p],
        lr=case.lr,
        betas=(case.beta1, case.beta2),
        eps=case.eps,
        weight_decay=case.weight_decay,
        amsgrad=case.amsgrad,
        maximize=case.maximize,
        foreach=False,
        fused=False,
    )


def _metadata(case: Case, final_step: int, torch_version: str) -> dict[str, str]:
    return {
        "format": FORMAT,
        "lr": repr(float(case.lr)),
        "beta1": repr(float(case.beta1)),
        "beta2": repr(float(case.beta2)),
        "eps": repr(float(case.eps)),
        "weight_decay": repr(float(case.weight_decay)),
        "mode": case.mode,
        "amsgrad": "true" if case.amsgrad else "false",
        "maximize": "true" if case.maximize else "false",
        "steps": str(case.steps),
        "step0": str(case.step0),
        "grad_dtype": case.grad_dtype,
        "grad_scale": "" if case.grad_scale is None else repr(float(case.grad_scale)),
        "final_step": str(final_step),
        "generator": f"dos scripts/gen_adam_cases.py torch {torch_version}",
        "description": case.description,
    }


def generate(case: Case) -> tuple[dict[str, torch.Tensor], int]:
    """Run PyTorch over the case; return the file's tensors and the final step counter."""
    gen = torch.Generator().manual_seed(case.seed)
    tensors: dict[str, torch.Tensor] = {}

    param0 = _initial_params(case, gen)
    tensors["param"] = param0.clone()
    p = torch.nn.Parameter(param0.clone())
    opt = _make_optimizer(case, p)

    if case.step0 > 0:
        warm = _warm_state(case, gen)
        for key, value in warm.items():
            tensors[key] = value.clone()
        opt.state[p] = {"step": torch.tensor(float(case.step0))}
        opt.state[p].update({key: value.clone() for key, value in warm.items()})

    step = case.step0
    for t in range(1, case.steps + 1):
        stored = _stored_grad(case, t, gen)
        tensors[f"grad.{t}"] = stored.clone()
        g = _as_fp32_grad(case, stored)
        if not bool(torch.isfinite(g).all()):
            tensors[f"expected.skipped.{t}"] = torch.ones(1, dtype=torch.uint8)
            continue
        p.grad = g
        opt.step()
        step += 1
        if t % case.save_every != 0 and t != case.steps:
            continue
        state = opt.state[p]
        if int(state["step"].item()) != step:
            raise AssertionError(f"{case.name}: step counter {state['step'].item()} != {step}")
        tensors[f"expected.param.{t}"] = p.detach().clone()
        tensors[f"expected.exp_avg.{t}"] = state["exp_avg"].clone()
        tensors[f"expected.exp_avg_sq.{t}"] = state["exp_avg_sq"].clone()
        if case.amsgrad:
            tensors[f"expected.max_exp_avg_sq.{t}"] = state["max_exp_avg_sq"].clone()
        for copy in case.copies:
            tensors[f"expected.param_{copy}.{t}"] = p.detach().to(COPY_DTYPES[copy])

    skipped = {int(name.rsplit(".", 1)[1]) for name in tensors if name.startswith("expected.skipped.")}
    if skipped != {t for t, _ in case.bad_at}:
        raise AssertionError(f"{case.name}: skipped calls {sorted(skipped)}, planned {case.bad_at}")
    for name, value in tensors.items():
        if name.startswith("expected.skipped."):
            continue
        if value.dim() != 1 or value.numel() != case.n:
            raise AssertionError(f"{case.name}: {name} has shape {tuple(value.shape)}")
    return tensors, step


# --------------------------------------------------------------------------- float64 check


def _rel_err(ours: torch.Tensor, exp: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """max_i |ours_i - exp_i| / max(|exp_i|, rms(exp)), over the elements in mask."""
    exp = exp.double()
    rms = exp.square().mean().sqrt()
    denom = torch.maximum(exp.abs(), rms)
    diff = (ours - exp).abs()
    err = torch.where(diff == 0, torch.zeros_like(diff), diff / denom)
    if mask is not None:
        err = err[mask]
    return err.max().item() if err.numel() else 0.0


def _as_f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def float64_check(case: Case, tensors: dict[str, torch.Tensor], torch_scalars: bool = False) -> float:
    """Redo the case in float64 from the stored inputs; return the largest relative error.

    With torch_scalars, the per-step constants are rounded to fp32 first, as PyTorch's
    CPU kernels do with a Python scalar operand on an fp32 tensor (the decay factor
    1-lr*wd, 1-beta1, beta2, 1-beta2, the bias-correction divisor, eps, the step size):
    over many steps those roundings, not the fp32 arithmetic, dominate the difference.
    """
    f64 = torch.float64
    r = _as_f32 if torch_scalars else float
    p = tensors["param"].to(f64)
    zeros = torch.zeros(case.n, dtype=f64)
    m = tensors.get("exp_avg", zeros).to(f64)
    v = tensors.get("exp_avg_sq", zeros).to(f64)
    vmax = tensors.get("max_exp_avg_sq", zeros).to(f64)
    b1, b2, lr, wd = case.beta1, case.beta2, case.lr, case.weight_decay
    step, worst = case.step0, 0.0
    for t in range(1, case.steps + 1):
        g = tensors[f"grad.{t}"].to(f64)
        if case.grad_scale is not None:
            g = g / case.grad_scale
        if not bool(torch.isfinite(g).all()):
            continue
        step += 1
        if case.maximize:
            g = -g
        if wd != 0.0:
            if case.mode == "adamw":
                p = p * r(1.0 - lr * wd)
            else:
                g = g + r(wd) * p
        m = m + r(1.0 - b1) * (g - m)
        v = r(b2) * v + r(1.0 - b2) * g * g
        vmax = torch.maximum(vmax, v)
        denom = (vmax if case.amsgrad else v).sqrt() / r(math.sqrt(1.0 - b2**step)) + r(case.eps)
        p = p + r(-lr / (1.0 - b1**step)) * m / denom
        if f"expected.param.{t}" not in tensors:
            continue
        errs = [
            _rel_err(p, tensors[f"expected.param.{t}"]),
            _rel_err(m, tensors[f"expected.exp_avg.{t}"]),
            _rel_err(v, tensors[f"expected.exp_avg_sq.{t}"], _normal(v, tensors[f"expected.exp_avg_sq.{t}"])),
        ]
        if case.amsgrad:
            exp_max = tensors[f"expected.max_exp_avg_sq.{t}"]
            errs.append(_rel_err(vmax, exp_max, _normal(vmax, exp_max)))
        worst = max(worst, *errs)
    return worst


def _normal(ours: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """Elements outside fp32's denormal range in both (or zero in both): the ones to compare."""
    both_normal = (ours.abs() >= FLT_MIN) & (exp.abs() >= FLT_MIN)
    both_zero = (ours == 0) & (exp == 0)
    return both_normal | both_zero


# --------------------------------------------------------------------------- writing


def write_case(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Save with safetensors, with the metadata in a fixed order so that the bytes are
    reproducible (safetensors writes `__metadata__` in hash-map order), then read back."""
    blob = save(tensors, metadata=metadata)
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    header.pop("__metadata__", None)
    text = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned, as safetensors does
    path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + header_len :])

    with safe_open(str(path), framework="pt") as f:
        if f.metadata() != metadata:
            raise AssertionError(f"{path}: metadata did not round-trip")
    back = load_file(str(path))
    for name, value in tensors.items():
        if back[name].dtype != value.dtype or not torch.equal(back[name].view(torch.uint8), value.view(torch.uint8)):
            raise AssertionError(f"{path}: {name} did not round-trip")
    if back.keys() != tensors.keys():
        raise AssertionError(f"{path}: tensor names did not round-trip")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    repo_root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=repo_root / "testdata" / "adam-cases",
                        help="output folder (default: testdata/adam-cases in the repo)")
    parser.add_argument("--only", nargs="*", default=None, help="generate only these case names")
    args = parser.parse_args(argv)

    # The reference is the plain CPU path: one thread, denormals kept.
    torch.set_num_threads(1)
    torch.set_flush_denormal(False)
    torch_version = torch.__version__

    cases = _cases()
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise AssertionError("duplicate case names")
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"unknown case(s): {', '.join(unknown)}; known: {', '.join(names)}")
        cases = [c for c in cases if c.name in args.only]

    args.out.mkdir(parents=True, exist_ok=True)
    total_bytes, failures = 0, 0
    for case in cases:
        tensors, final_step = generate(case)
        err = float64_check(case, tensors)
        err_scalars = float64_check(case, tensors, torch_scalars=True)
        path = args.out / f"{case.name}.safetensors"
        write_case(path, tensors, _metadata(case, final_step, torch_version))
        total_bytes += path.stat().st_size
        note = ""
        if min(err, err_scalars) > BUG_TOLERANCE:
            failures += 1
            note = "  ERROR: PyTorch's result is far from a float64 recomputation"
        elif err > F64_TOLERANCE:
            note = f"  (float64 recomputation over {F64_TOLERANCE:g})"
        print(f"{case.name} n={case.n} steps={case.steps} final_step={final_step}"
              f" f64_err={err:.2e} f64_err_fp32_scalars={err_scalars:.2e}{note}")
    print(f"wrote {len(cases)} cases, {total_bytes} bytes, to {args.out}", file=sys.stderr)
    print(f"torch {torch_version}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
