"""Kernel benchmark: ``python -m ashl.bench kernels --json PATH [--repeat N] [--device D] [--quick]``.

Times every fused kernel of :mod:`ashl.kernels` on the parameter lists of real models
(:mod:`ashl.bench.shapes`: VGG-16 and ResNet-18 for CIFAR, a 25M-element transformer) and, in
the same run and on the same data, two plain-torch ways to get the same result:

* ``foreach``: ``torch._foreach_*`` ops on the tensor list (writing through views of the flat
  buffer where the op has a flat side);
* ``flat``: plain torch ops on pre-flattened contiguous buffers (the best case for torch: one
  big tensor per operand, e.g. ``torch.sub(flat_p, flat_a, out=out)``).

Every variant's result is checked against ashl's once per case, outside the timed region. The
torch variants of ``merge_dense``/``merge_sparse`` include a NaN/Inf guard, as ashl's kernels
do (foreach: ``_foreach_norm``; flat: ``aminmax``); sparse merging has no foreach form.

Timing is min-of-N after warm-up (the median beside it shows the noise), the variants
interleaved round by round, with ``torch.cuda.synchronize()`` around each call on CUDA. ``bytes`` is the least memory traffic the
op needs (every operand read once, every result written once; for the sparse merge the indices
and values read, and every touched 64-byte line of ``dst`` read and written: a scatter moves
whole cache lines), and ``bandwidth_fraction`` is
``bytes / ashl_s`` over the machine's copy bandwidth (best ``dst.copy_(src)`` of a large
buffer, counting read + write, measured before and after the cases: the better reading is
used, and readings more than 10% apart mark the run unreliable). A fraction above 1 is
possible: a copy that writes through the cache also reads every destination line first (write
allocate), which streaming stores avoid.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from ashl.bench.shapes import ShapeList, model_shapes
from ashl.kernels import FlatTensors
from ashl.outer import PlainMerge
from ashl.planner import PlannerConfig

OPS = ["pack_delta", "pack_delta+residual", "pack_delta_fp16", "unpack_assign", "unpack_add",
       "merge_dense", "merge_sparse", "weighted_sum"]
LISTS = ["vgg16", "resnet18", "transformer", "transformer-small"]
SCALE = 0.5  # pack_delta+residual
MERGE_WEIGHT = 0.25
# merge_sparse: the top-k ratio of ashl's default SHL plan (its bottleneck's; the others send
# more), the sparsest commit a default plan sends
SPARSE_RATIO = PlannerConfig().shl_target_ratio
WS_WEIGHTS = [0.4, 0.3, 0.2, 0.1]  # weighted_sum, K = 4
VARIANTS = ("ashl", "foreach", "flat")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed calls per variant, the minimum is kept (default 10; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per variant first")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true",
                   help="tiny versions of the models: a smoke test that runs in seconds")
    p.add_argument("--lists", nargs="+", choices=LISTS, default=LISTS, metavar="LIST",
                   help=f"parameter lists to run (default: all of {', '.join(LISTS)})")
    p.add_argument("--ops", nargs="+", choices=OPS, default=OPS, metavar="OP",
                   help=f"ops to run (default: all of {', '.join(OPS)})")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for both ashl and torch (default: their defaults)")
    p.add_argument("--storage", choices=STORAGES, default=None,
                   help="how the model's tensors are stored: flat (views of one buffer) or "
                        "separate (one allocation each); default: as ashl.DistributedOptimizer "
                        "stores a model on the device, flat on cpu, separate on cuda")
    p.add_argument("--sparse-ratio", type=float, default=SPARSE_RATIO, metavar="R",
                   help="merge_sparse's share of the elements, sorted as top-k sends them "
                        f"(default {SPARSE_RATIO}: PlannerConfig.shl_target_ratio)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--isa", default="auto",
                   help="the CPU kernels' fp16/bf16 conversion path: auto (the best this CPU "
                        "has), avx512, f16c or portable")


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    import ashl.kernels as K
    try:
        K.set_cpu_isa(args.isa)
    except ValueError as e:
        print(f"error: --isa: {e}", file=sys.stderr)
        return 2
    if not 0 < args.sparse_ratio <= 1:
        print(f"error: --sparse-ratio must be in (0, 1], got {args.sparse_ratio}",
              file=sys.stderr)
        return 2
    result = run_benchmark(device=args.device, repeat=args.repeat, warmup=args.warmup,
                           quick=args.quick, lists=args.lists, ops=args.ops,
                           threads=args.threads, seed=args.seed, storage=args.storage,
                           sparse_ratio=args.sparse_ratio)
    print(format_table(result))
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0


# --------------------------------------------------------------------------------------------
# timing


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_variants(fns: Dict[str, Callable[[], object]], repeat: int, warmup: int,
                  device: torch.device) -> Dict[str, List[float]]:
    """``repeat`` timings in seconds per function; rounds interleave the functions so that a
    noisy neighbour or frequency change hurts them all alike."""
    sync = _sync(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def copy_bandwidth(device: torch.device, numel: int, repeat: int = 5) -> float:
    """Best ``dst.copy_(src)`` bandwidth in bytes/s, counting the read and the write."""
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = min(time_variants({"copy": lambda: dst.copy_(src)}, repeat, 2, device)["copy"])
    return 2 * numel * 4 / t


# The copy bandwidth measured before and after the cases may differ by this much before the
# run is marked unreliable (a neighbour took the memory bus for part of it).
BANDWIDTH_DRIFT = 0.10


def bandwidth_drift(before: float, after: float) -> float:
    """How far the two copy-bandwidth readings are apart, relative to the larger."""
    return abs(before - after) / max(before, after)


# --------------------------------------------------------------------------------------------
# cases


@dataclass
class Case:
    op: str
    tensors: str
    numel: int
    bytes: int
    fns: Dict[str, Optional[Callable[[], object]]]
    # run variant `name` once from the initial state and return its result (flat, cpu)
    result: Callable[[str], torch.Tensor]
    rtol: float = 1e-5
    atol: float = 1e-5
    notes: str = ""


STORAGES = ("flat", "separate")


class ListData:
    """A model's parameter list on ``device``, stored as ``storage`` says: ``flat``, views of
    one buffer (FlatTensors), as ``ashl.DistributedOptimizer`` stores a model
    (``flat_storage``, a CPU model by default); ``separate``, each tensor its own allocation, as a
    model holds them otherwise. Beside it, the same values in separate flat buffers."""

    def __init__(self, name: str, shapes: ShapeList, device: torch.device, seed: int,
                 storage: str = "flat"):
        if storage not in STORAGES:
            raise ValueError(f"storage {storage!r}: expected one of {', '.join(STORAGES)}")
        self.name, self.device, self.storage = name, device, storage
        self.shapes = [s for _, s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.n = sum(self.numels)
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        self._g = g

    def flat_random(self, scale: float = 1.0) -> torch.Tensor:
        t = torch.empty(self.n, dtype=torch.float32)
        t.normal_(0.0, scale, generator=self._g)
        return t.to(self.device)

    def as_list(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """The model's tensors holding ``flat``'s values, stored as ``storage`` says."""
        if self.storage == "flat":
            return FlatTensors.of(self.views(flat.clone()))
        return [v.view(s).clone() for v, s in zip(flat.split(self.numels), self.shapes)]

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [v.view(s) for v, s in zip(flat.split(self.numels), self.shapes)]


def cat(ts: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts]).float().cpu()


def build_case(op: str, L: ListData, K, sparse_ratio: float = SPARSE_RATIO) -> Case:
    """The case of `op` on parameter list `L`, `K` being ashl.kernels."""
    try:
        builder = _BUILDERS[op]
    except KeyError:
        raise ValueError(f"unknown op {op}") from None
    return builder(L, K, sparse_ratio) if op == "merge_sparse" else builder(L, K)


def _result_of(fns: Dict[str, Callable[[], object]],
               out: torch.Tensor) -> Callable[[str], torch.Tensor]:
    """For ops that write `out` and read nothing they write: run the variant, return out."""
    def result(v):
        fns[v]()
        return out.float().cpu()
    return result


def _pack_delta(L: ListData, K) -> Case:
    fp, fa = L.flat_random(), L.flat_random()
    P, A = L.as_list(fp), L.as_list(fa)
    out = torch.empty(L.n, device=L.device)
    V = L.views(out)
    fns = {
        "ashl": lambda: K.pack_delta(P, A, out),
        "foreach": lambda: (torch._foreach_copy_(V, P), torch._foreach_sub_(V, A)),
        "flat": lambda: torch.sub(fp, fa, out=out),
    }
    return Case("pack_delta", L.name, L.n, 3 * 4 * L.n, fns, _result_of(fns, out), 0.0, 0.0)


def _pack_delta_residual(L: ListData, K) -> Case:
    fp, fa = L.flat_random(), L.flat_random()
    P, A = L.as_list(fp), L.as_list(fa)
    fr = L.flat_random(0.01)
    R = L.as_list(fr)
    out = torch.empty(L.n, device=L.device)
    V = L.views(out)

    def foreach():  # four passes
        torch._foreach_copy_(V, P)
        torch._foreach_sub_(V, A)
        torch._foreach_mul_(V, SCALE)
        torch._foreach_add_(V, R)

    def flat():  # two passes: out = p - a; out = r + scale * out
        torch.sub(fp, fa, out=out)
        torch.add(fr, out, alpha=SCALE, out=out)

    fns = {"ashl": lambda: K.pack_delta(P, A, out, SCALE, R), "foreach": foreach, "flat": flat}
    return Case("pack_delta+residual", L.name, L.n, 4 * 4 * L.n, fns, _result_of(fns, out),
                1e-5, 1e-6)


def _pack_delta_fp16(L: ListData, K) -> Case:
    fp, fa = L.flat_random(), L.flat_random()
    P, A = L.as_list(fp), L.as_list(fa)
    out = torch.empty(L.n, dtype=torch.float16, device=L.device)
    V = L.views(out)
    # foreach has no out= form: compute the fp32 difference, then cast into the buffer
    fns = {
        "ashl": lambda: K.pack_delta(P, A, out),
        "foreach": lambda: torch._foreach_copy_(V, torch._foreach_sub(P, A)),
        "flat": lambda: torch.sub(fp, fa, out=out),  # fp32 math, cast on store
    }
    return Case("pack_delta_fp16", L.name, L.n, (4 + 4 + 2) * L.n, fns, _result_of(fns, out),
                1e-3, 1e-3)


def _unpack(op: str, L: ListData, K) -> Case:
    """unpack_assign / unpack_add: params and anchors from a flat buffer."""
    n, dev = L.n, L.device
    ff, fa0 = L.flat_random(0.01), L.flat_random()
    P, A = L.as_list(torch.zeros(n, device=dev)), L.as_list(fa0)
    fp, fa = torch.zeros(n, device=dev), fa0.clone()
    V = L.views(ff)
    if op == "unpack_assign":
        fns = {
            "ashl": lambda: K.unpack_assign(P, A, ff),
            "foreach": lambda: (torch._foreach_copy_(P, V), torch._foreach_copy_(A, V)),
            "flat": lambda: (fp.copy_(ff), fa.copy_(ff)),
        }
        nbytes = 3 * 4 * n
    else:
        fns = {
            "ashl": lambda: K.unpack_add(P, A, ff),
            "foreach": lambda: (torch._foreach_add_(A, V), torch._foreach_copy_(P, A)),
            "flat": lambda: (fa.add_(ff), fp.copy_(fa)),
        }
        nbytes = 4 * 4 * n

    def result(v):
        # start from the same anchors, then return params and anchors
        if v == "flat":
            fa.copy_(fa0)
            fp.zero_()
            fns[v]()
            return torch.cat([fp.cpu(), fa.cpu()])
        torch._foreach_copy_(A, L.views(fa0))
        torch._foreach_zero_(P)
        fns[v]()
        return torch.cat([cat(P), cat(A)])

    return Case(op, L.name, n, nbytes, fns, result, 0.0, 0.0)


def _merge_dense(L: ListData, K) -> Case:
    fd0, fe = L.flat_random(), L.flat_random(0.01)
    D, E = L.as_list(fd0), L.as_list(fe)
    fd = fd0.clone()

    def foreach():
        if bool(torch.stack(torch._foreach_norm(E)).isfinite().all()):
            torch._foreach_add_(D, E, alpha=MERGE_WEIGHT)
            return True
        return False

    def flat():
        if bool(torch.stack(torch.aminmax(fe)).isfinite().all()):
            fd.add_(fe, alpha=MERGE_WEIGHT)
            return True
        return False

    # As the server merges (outer.PlainMerge): a large host model into a second buffer that
    # then becomes the model, so the calls take turns between two lists; a small one in place.
    turns = {"dst": D, "spare": L.as_list(torch.empty_like(fd0))}
    double_buffered = L.device.type == "cpu" and L.n >= PlainMerge.double_buffer_numel

    def ashl():
        if not double_buffered:
            assert K.merge_dense(turns["dst"], E, MERGE_WEIGHT)
            return
        assert K.merge_dense(turns["dst"], E, MERGE_WEIGHT, out=turns["spare"])
        turns["dst"], turns["spare"] = turns["spare"], turns["dst"]

    fns = {"ashl": ashl, "foreach": foreach, "flat": flat}

    def result(v):
        if v == "flat":
            fd.copy_(fd0)
            fns[v]()
            return fd.cpu()
        for dst in (D, turns["dst"]):
            torch._foreach_copy_(dst, L.views(fd0))
        fns[v]()
        return cat(turns["dst"] if v == "ashl" else D)

    return Case("merge_dense", L.name, L.n, 3 * 4 * L.n, fns, result, 1e-6, 1e-6,
                "torch variants include a NaN/Inf guard; ashl merges as the server does, "
                "into a second buffer from %d elements" % PlainMerge.double_buffer_numel)


def _merge_sparse(L: ListData, K, ratio: float) -> Case:
    n, dev = L.n, L.device
    nnz = max(1, int(n * ratio))
    fd0 = L.flat_random()
    fd = fd0.clone()
    # Sorted ascending, as ashl.compression's top-k sends them.
    idx = torch.randperm(n, generator=L._g)[:nnz].sort().values.to(torch.int32).to(dev)
    # A scatter moves whole cache lines: its minimum traffic is every touched
    # 64-byte line of dst read and written once, plus the indices and values.
    lines = int(torch.unique(idx.long() // (64 // fd.element_size())).numel())
    vals = L.flat_random(0.01)[:nnz].clone()

    def flat():
        if bool(torch.stack(torch.aminmax(vals)).isfinite().all()):
            fd.index_add_(0, idx, vals, alpha=MERGE_WEIGHT)
            return True
        return False

    def ashl():
        assert K.merge_sparse(fd, idx, vals, MERGE_WEIGHT)

    fns = {"ashl": ashl, "foreach": None, "flat": flat}

    def result(v):
        fd.copy_(fd0)
        fns[v]()
        return fd.cpu()

    return Case("merge_sparse", L.name, n, nnz * (4 + 4) + lines * 64 * 2, fns, result, 1e-6, 1e-6,
                f"nnz={nnz} sorted, {lines} dst lines; no foreach form; "
                "flat = guarded index_add_")


def _weighted_sum(L: ListData, K) -> Case:
    n, dev = L.n, L.device
    flats = [L.flat_random() for _ in WS_WEIGHTS]
    ins = [L.as_list(f) for f in flats]
    O = L.as_list(torch.zeros(n, device=dev))
    fo = torch.zeros(n, device=dev)
    w = WS_WEIGHTS

    def foreach():  # five passes
        torch._foreach_copy_(O, ins[0])
        torch._foreach_mul_(O, w[0])
        for k in range(1, len(w)):
            torch._foreach_add_(O, ins[k], alpha=w[k])

    def flat():  # four passes
        torch.mul(flats[0], w[0], out=fo)
        for k in range(1, len(w)):
            fo.add_(flats[k], alpha=w[k])

    fns = {"ashl": lambda: K.weighted_sum(O, ins, w), "foreach": foreach, "flat": flat}

    def result(v):
        fns[v]()
        return fo.cpu() if v == "flat" else cat(O)

    return Case("weighted_sum", L.name, n, (len(w) + 1) * 4 * n, fns, result, 1e-5, 1e-5)


# op -> its case builder, (ListData, ashl.kernels) -> Case
_BUILDERS: Dict[str, Callable[[ListData, object], Case]] = {
    "pack_delta": _pack_delta,
    "pack_delta+residual": _pack_delta_residual,
    "pack_delta_fp16": _pack_delta_fp16,
    "unpack_assign": lambda L, K: _unpack("unpack_assign", L, K),
    "unpack_add": lambda L, K: _unpack("unpack_add", L, K),
    "merge_dense": _merge_dense,
    "merge_sparse": _merge_sparse,
    "weighted_sum": _weighted_sum,
}
assert list(_BUILDERS) == OPS


# --------------------------------------------------------------------------------------------
# driver


def run_benchmark(device: str = "cpu", repeat: Optional[int] = None, warmup: int = 2,
                  quick: bool = False, lists=LISTS, ops=OPS, threads: Optional[int] = None,
                  seed: int = 0, storage: Optional[str] = None,
                  sparse_ratio: float = SPARSE_RATIO, log=print) -> dict:
    """``storage`` None: as ashl.DistributedOptimizer stores a model on ``device``."""
    import ashl.kernels as K

    dev = torch.device(device)
    storage = storage or ("flat" if dev.type == "cpu" else "separate")
    if threads is not None:
        torch.set_num_threads(threads)
        K.set_num_threads(threads)
    repeat = repeat if repeat is not None else (3 if quick else 10)
    bw_numel = (1 << 23) if quick else ((1 << 26) if dev.type == "cpu" else (1 << 28))
    bw_repeat = 3 if quick else 10
    before = copy_bandwidth(dev, bw_numel, repeat=bw_repeat)
    log(f"copy bandwidth: {before / 1e9:.1f} GB/s ({bw_numel * 4 >> 20} MiB buffers)")

    cases_out = _time_cases(dev, lists, ops, K, shapes=model_shapes(quick), seed=seed,
                            storage=storage, sparse_ratio=sparse_ratio, repeat=repeat,
                            warmup=warmup, bandwidth_before=before, log=log)
    # Measured again at the end: fractions use the better reading, so a busy moment does not
    # inflate them, and readings far apart mark the whole run unreliable.
    after = copy_bandwidth(dev, bw_numel, repeat=bw_repeat)
    bandwidth = max(before, after)
    for row in cases_out:
        row["bandwidth_fraction"] = row["bytes"] / row["ashl_s"] / bandwidth
    drift = bandwidth_drift(before, after)

    return {
        "bandwidth_gbps": bandwidth / 1e9,
        "bandwidth_before_gbps": before / 1e9,
        "bandwidth_after_gbps": after / 1e9,
        "bandwidth_drift": drift,
        "reliable": drift <= BANDWIDTH_DRIFT,
        "device": describe_device(dev),
        "threads": K.num_threads() if dev.type == "cpu" else None,
        "isa": K.cpu_isa() if dev.type == "cpu" else None,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "storage": storage,
        "sparse_ratio": sparse_ratio,
        "repeat": repeat,
        "warmup": warmup,
        "quick": quick,
        "bytes_per_gb": 1e9,
        "cases": cases_out,
    }


def _time_cases(dev, lists, ops, K, *, shapes, seed, storage, sparse_ratio, repeat, warmup,
                bandwidth_before, log) -> list[dict]:
    """One row per (tensor list, op): every variant checked against ashl's, then timed."""
    rows = []
    for li, name in enumerate(lists):
        L = ListData(name, shapes[name], dev, seed + li, storage)
        for op in ops:
            case = build_case(op, L, K, sparse_ratio)
            check_case(case)
            fns = {k: f for k, f in case.fns.items() if f is not None}
            t = time_variants(fns, repeat, warmup, dev)
            row = make_row(case, t, bandwidth_before, len(L.shapes))
            rows.append(row)
            log(format_row(row))
            del case, fns
        del L
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def check_case(case: Case) -> None:
    """Every torch variant must produce ashl's result (outside the timed region)."""
    ref = case.result("ashl")
    for v in ("foreach", "flat"):
        if case.fns.get(v) is None:
            continue
        got = case.result(v)
        try:
            torch.testing.assert_close(got, ref, rtol=case.rtol, atol=case.atol)
        except AssertionError as e:
            raise AssertionError(f"{case.op} on {case.tensors}: the {v} variant disagrees with "
                                 f"ashl:\n{e}") from None


def make_row(case: Case, t: Dict[str, List[float]], bandwidth: float, n_tensors: int) -> dict:
    """Min (the figure compared) and median (its noise) of each variant."""
    best = {k: min(v) for k, v in t.items()}
    mid = {k: statistics.median(v) for k, v in t.items()}
    a = best["ashl"]
    fe, fl = best.get("foreach"), best.get("flat")
    return {
        "op": case.op,
        "tensors": case.tensors,
        "n_tensors": n_tensors,
        "numel": case.numel,
        "bytes": case.bytes,
        "ashl_s": a,
        "foreach_s": fe,
        "flat_s": fl,
        "ashl_median_s": mid["ashl"],
        "foreach_median_s": mid.get("foreach"),
        "flat_median_s": mid.get("flat"),
        "speedup_vs_foreach": fe / a if fe is not None else None,
        "speedup_vs_flat": fl / a if fl is not None else None,
        "speedup_vs_flat_median": mid["flat"] / mid["ashl"] if fl is not None else None,
        "ashl_gbps": case.bytes / a / 1e9,
        "bandwidth_fraction": case.bytes / a / bandwidth,
        "notes": case.notes,
    }


def describe_device(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(dev)}"
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cpus)"


# --------------------------------------------------------------------------------------------
# output

_COLS = [("op", 20, "op"), ("tensors", 11, "tensors"), ("numel", 10, "numel"),
         ("ashl ms", 9, "ashl_s"), ("foreach ms", 10, "foreach_s"), ("flat ms", 9, "flat_s"),
         ("x foreach", 9, "speedup_vs_foreach"), ("x flat", 7, "speedup_vs_flat"),
         ("(median)", 8, "speedup_vs_flat_median"),
         ("GB/s", 7, "ashl_gbps"), ("% bw", 6, "bandwidth_fraction")]


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key.endswith("_s"):
        return f"{v * 1e3:.3f}"
    if key.startswith("speedup"):
        return f"{v:.2f}"
    if key == "ashl_gbps":
        return f"{v:.1f}"
    if key == "bandwidth_fraction":
        return f"{100 * v:.0f}%"
    return str(v)


def format_row(row: dict) -> str:
    return " ".join(_fmt(k, row[k]).rjust(w) if i > 1 else _fmt(k, row[k]).ljust(w)
                    for i, (_, w, k) in enumerate(_COLS))


def format_table(result: dict) -> str:
    head = " ".join(h.rjust(w) if i > 1 else h.ljust(w) for i, (h, w, _) in enumerate(_COLS))
    lines = [f"device: {result['device']}  threads: {result['threads']} isa: {result['isa']} "
             f"(torch {result['torch_threads']})  copy bandwidth: "
             f"{result['bandwidth_before_gbps']:.1f} GB/s before, "
             f"{result['bandwidth_after_gbps']:.1f} after  min of {result['repeat']}  "
             f"storage: {result.get('storage', 'separate')}  "
             f"merge_sparse: top {result.get('sparse_ratio', 0.01):.4g} of the elements",
             head, "-" * len(head)]
    lines += [format_row(r) for r in result["cases"]]
    if not result["reliable"]:
        lines.append(f"UNRELIABLE: the copy bandwidth moved by "
                     f"{100 * result['bandwidth_drift']:.0f}% during the run (more than "
                     f"{100 * BANDWIDTH_DRIFT:.0f}%): something else used the memory bus")
    return "\n".join(lines)
