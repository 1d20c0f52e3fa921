"""The performance table (DESIGN.md section 7): lowered batch-norm backward in onnxruntime vs. memory and torch.

Every benchmark model goes through the real pass (``lowering.lower_model`` on a oneDNN Graph
``BatchNormTrainingBackward`` node). Timing follows DESIGN.md section 7: outputs preallocated on both sides
(IOBinding into caller-owned buffers; glibc told to keep freed memory so torch's fresh outputs do not
page-fault), single runs of each side interleaved with short busy pauses, medians quoted. torch is used
only when importable; so is the peer (:mod:`lowering.bench.peer`: PyTorch's own decomposition exported to
ONNX, what a user gets without oplower), timed in the same onnxruntime the same way, f32 only.
"""

from __future__ import annotations

import ctypes
import importlib
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

RESNET50 = ((64, 112), (256, 56), (64, 56), (512, 28), (128, 28), (1024, 14), (256, 14), (2048, 7), (512, 7))
QUICK = ((64, 56), (256, 14), (512, 7))
TINY = ((4, 5),)
BATCH = 32
DTYPES = {"f32": TensorProto.FLOAT, "bf16": TensorProto.BFLOAT16, "f16": TensorProto.FLOAT16}
NP_DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
TENSOR_PASSES = 5  # a fused kernel reads src and diff_dst twice and writes diff_src once
WARMUP = 5  # untimed rounds first: pages, arenas, thread pools, glibc's heap grown to its working size
# Between timed runs: a short pause for threads that spin after a run (torch's OpenMP workers) to park,
# spent busy on this thread. A sleep of 20 ms instead let this VM park its idle cores and made the next call
# of either side up to 10x slower on the small layers, which squeezed every ratio towards 1.
PAUSE = 0.002


@dataclass
class CaseResult:
    layout: str
    dtype: str
    channels: int
    size: int  # H = W
    batch: int
    ms: float
    gbps: float  # effective: 5 tensor sizes / time
    vs_bound: float  # time / (5 tensor sizes at the copy bandwidth)
    torch_ms: float | None = None
    vs_torch: float | None = None
    peer_ms: float | None = None  # the exported decomposition in onnxruntime (f32, torch importable)
    peer_speedup: float | None = None  # peer_ms / ms: > 1 when the lowering is faster


def onednn_model(shape: tuple[int, ...], layout: str, io_type: int, stat_type: int = TensorProto.FLOAT,
                 nodes: int = 1, opset: int = 17) -> onnx.ModelProto:
    """``nodes`` oneDNN Graph BatchNormTrainingBackward nodes sharing their inputs, all outputs requested."""
    channels = shape[1] if layout == "NCX" else shape[-1]
    vi = helper.make_tensor_value_info
    inputs = [vi("src", io_type, shape), vi("diff_dst", io_type, shape)] + [
        vi(name, stat_type, [channels]) for name in ("mean", "variance", "gamma")]
    graph_nodes, outputs = [], []
    for i in range(nodes):
        names = [f"diff_src_{i}", f"diff_gamma_{i}", f"diff_beta_{i}"]
        graph_nodes.append(helper.make_node("BatchNormTrainingBackward", ["src", "diff_dst", "mean", "variance",
                                                                          "gamma"], names, name=f"bn_{i}",
                                            domain="onednn", epsilon=1e-5, data_format=layout))
        outputs += [vi(names[0], io_type, shape), vi(names[1], stat_type, [channels]),
                    vi(names[2], stat_type, [channels])]
    graph = helper.make_graph(graph_nodes, "bench", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("onednn", 1)])
    model.ir_version = 10
    return model


def lowered_model(shape, layout, io_type, stat_type=TensorProto.FLOAT, nodes=1,
                  target: str = "onnxruntime") -> onnx.ModelProto:
    from lowering import lower_model

    return lower_model(onednn_model(shape, layout, io_type, stat_type, nodes), target=target)


def read_by_a_node(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (one node, from :func:`onednn_model`) with diff_src read by a ReduceSum over every axis (the
    graph output ``dx_sum``) instead of being a graph output itself: how a training graph uses it."""
    graph = model.graph
    graph.node.append(helper.make_node("ReduceSum", ["diff_src_0"], ["dx_sum"], keepdims=0))
    index = next(i for i, o in enumerate(graph.output) if o.name == "diff_src_0")
    graph.output.pop(index)
    graph.output.insert(index, helper.make_tensor_value_info("dx_sum", TensorProto.FLOAT, []))
    return model


def keep_freed_memory() -> None:
    """Stop glibc from unmapping big freed blocks, so a fresh output reuses warm pages (no page faults).

    Without M_TOP_PAD, torch's f32 backward page-faulted a whole fresh output (6,240 faults at 32x64x56x56)
    on every second call and measured 2-4x slower than it runs (counted with getrusage's ru_minflt)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX: serve big blocks from the heap
        libc.mallopt(-1, 1 << 40)  # M_TRIM_THRESHOLD: never give the heap back
        libc.mallopt(-2, 1 << 30)  # M_TOP_PAD: grow the heap in big steps, so freed tops are reused warm
    except (OSError, AttributeError):
        pass


def copy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Copy bandwidth in GB/s counting bytes read + written (best of one and two threads)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    halves = [(src[: len(src) // 2], dst[: len(src) // 2]), (src[len(src) // 2:], dst[len(src) // 2:])]

    def two_threads() -> None:
        threads = [threading.Thread(target=np.copyto, args=(d, s)) for s, d in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    best = 0.0
    for fn in (lambda: np.copyto(dst, src), two_threads):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best = max(best, 2 * nbytes / statistics.median(times) / 1e9)
    return best


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _torch():
    try:
        return importlib.import_module("torch")
    except Exception:  # torch is optional; a broken install counts as absent
        return None


def _torch_runner(torch, x: np.ndarray, dy: np.ndarray, layout: str, dtype: str,
                  then_sum: bool = False) -> Callable[[], object]:
    tdtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]

    def tensor(a: np.ndarray):
        t = torch.from_numpy(a.astype(np.float32)).to(tdtype)
        return t.permute(0, 3, 1, 2) if layout == "NXC" else t  # NXC: a channels_last NCHW tensor

    tx, tdy = tensor(x), tensor(dy)
    channels = tx.shape[1]
    mean, invstd, weight = torch.zeros(channels), torch.ones(channels), torch.ones(channels)
    op = torch.ops.aten.native_batch_norm_backward

    def run():
        return op(tdy, tx, weight, None, None, mean, invstd, True, 1e-5, [True, True, True])

    if then_sum:
        return lambda: run()[0].sum()

    return run


def _warm_torch(torch) -> None:
    x = np.random.default_rng(0).standard_normal((32, 64, 56, 56), dtype=np.float32)
    for dtype in ("f32", "bf16", "f16"):
        run = _torch_runner(torch, x, x, "NCX", dtype)
        for _ in range(3):
            run()


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def time_case(layout: str, dtype: str, channels: int, size: int, batch: int, reps: int, bandwidth: float,
              torch=None, target: str = "onnxruntime") -> CaseResult:
    from runtime.session import PreparedModel

    shape = (batch, channels, size, size) if layout == "NCX" else (batch, size, size, channels)
    io_type = DTYPES[dtype]
    model = lowered_model(shape, layout, io_type, target=target)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32).astype(NP_DTYPES[dtype])
    dy = rng.standard_normal(shape, dtype=np.float32).astype(NP_DTYPES[dtype])
    vec = np.ones(channels, np.float32)
    feeds = {"src": x, "diff_dst": dy, "mean": vec * 0, "variance": vec, "gamma": vec}
    outputs = {"diff_src_0": np.empty(shape, x.dtype), "diff_gamma_0": np.empty_like(vec),
               "diff_beta_0": np.empty_like(vec)}
    # no spinning: on 2 cores, onnxruntime workers that spin after a run steal the cores from the next
    # runner (torch, or onnxruntime itself behind torch's OpenMP threads); measured faster for both sides
    prepared = PreparedModel(model, allow_spinning=False)
    prepared.bind(feeds, outputs)
    runners = {"ort": prepared.run_bound}
    if torch is not None:
        runners["torch"] = _torch_runner(torch, x, dy, layout, dtype)
        if dtype == "f32":
            runners["peer"] = _peer_runner(torch, x, dy, layout)
    times = _interleaved(runners, reps)
    ms = _median_ms(times["ort"])
    traffic = TENSOR_PASSES * x.nbytes
    result = CaseResult(layout, dtype, channels, size, batch, ms, traffic / ms / 1e6,
                        ms / (traffic / bandwidth / 1e6))
    if "torch" in times:
        result.torch_ms = _median_ms(times["torch"])
        result.vs_torch = ms / result.torch_ms
    if "peer" in times:
        result.peer_ms = _median_ms(times["peer"])
        result.peer_speedup = result.peer_ms / ms
    return result


def _peer_runner(torch, x: np.ndarray, dy: np.ndarray, layout: str) -> Callable[[], object]:
    """The peer model (built here from torch) prepared like the lowering: no spinning, inputs bound once,
    outputs into preallocated buffers; mean 0, inv_std 1 and gamma 1 as the lowering gets them."""
    from lowering.bench import peer
    from runtime.session import PreparedModel

    channels = x.shape[1] if layout == "NCX" else x.shape[-1]
    vec = np.ones(channels, np.float32)
    prepared = PreparedModel(peer.peer_model(torch, x.shape, layout), allow_spinning=False)
    prepared.bind(dict(zip(peer.PEER_INPUTS, (dy, x, vec, vec * 0, vec), strict=True)),
                  dict(zip(peer.PEER_OUTPUTS, (np.empty_like(x), np.empty_like(vec), np.empty_like(vec)),
                           strict=True)))
    return prepared.run_bound


def time_in_graph(layout: str, channels: int, size: int, batch: int, reps: int, torch=None,
                  target: str = "onnxruntime") -> dict:
    """f32, diff_src read by a ReduceSum (:func:`read_by_a_node`; the lowering then may work in place, see
    lowering/rules/batch_norm_backward/emit.py) against torch's backward followed by ``.sum()`` of its diff_src."""
    from lowering import lower_model
    from runtime.session import PreparedModel

    shape = (batch, channels, size, size) if layout == "NCX" else (batch, size, size, channels)
    model = lower_model(read_by_a_node(onednn_model(shape, layout, TensorProto.FLOAT)), target=target)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    vec = np.ones(channels, np.float32)
    prepared = PreparedModel(model, allow_spinning=False)
    prepared.bind({"src": x, "diff_dst": dy, "mean": vec * 0, "variance": vec, "gamma": vec},
                  {"dx_sum": np.empty((), np.float32), "diff_gamma_0": np.empty_like(vec),
                   "diff_beta_0": np.empty_like(vec)})
    runners = {"ort": prepared.run_bound}
    if torch is not None:
        runners["torch"] = _torch_runner(torch, x, dy, layout, "f32", then_sum=True)
    times = _interleaved(runners, reps)
    row = {"layout": layout, "channels": channels, "size": size, "ms": _median_ms(times["ort"]),
           "torch_ms": None, "vs_torch": None}
    if "torch" in times:
        row["torch_ms"] = _median_ms(times["torch"])
        row["vs_torch"] = row["ms"] / row["torch_ms"]
    return row


def _interleaved(runners: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Each runner's times: WARMUP untimed rounds, then ``reps`` single runs of each, interleaved with short
    busy pauses. Odd rounds run the runners after the first in reverse (A B C, A C B, A B C ...), so with
    three runners each one follows each of the others equally often and never itself (a fixed order would
    always put the peer right behind torch's OpenMP threads); two runners simply alternate."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(WARMUP):
        for fn in runners.values():
            fn()
    order = list(runners.items())
    for round_ in range(reps):
        for key, fn in order if round_ % 2 == 0 else order[:1] + order[:0:-1]:
            _busy_wait(PAUSE)
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return times


def distinct_model(nodes: int, base_channels: int = 4) -> onnx.ModelProto:
    """``nodes`` NCX f32 nodes, each with its own inputs and its own channel count (no two alike)."""
    vi = helper.make_tensor_value_info
    graph_nodes, inputs, outputs = [], [], []
    for i in range(nodes):
        c, p = base_channels + i, f"bn{i}_"
        inputs += [vi(p + "src", TensorProto.FLOAT, [2, c, 3, 3]), vi(p + "diff_dst", TensorProto.FLOAT, [2, c, 3, 3])]
        inputs += [vi(p + k, TensorProto.FLOAT, [c]) for k in ("mean", "variance", "gamma")]
        graph_nodes.append(helper.make_node(
            "BatchNormTrainingBackward", [p + k for k in ("src", "diff_dst", "mean", "variance", "gamma")],
            [p + k for k in ("diff_src", "diff_gamma", "diff_beta")], name=p, domain="onednn", epsilon=1e-5,
            data_format="NCX"))
        outputs += [vi(p + "diff_src", TensorProto.FLOAT, [2, c, 3, 3])]
        outputs += [vi(p + k, TensorProto.FLOAT, [c]) for k in ("diff_gamma", "diff_beta")]
    graph = helper.make_graph(graph_nodes, "bench_distinct", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onednn", 1)])
    model.ir_version = 10
    return model


def time_pass(node_counts: tuple[int, ...], shape=(2, 4, 3, 3), repeats: int = 3) -> list[dict]:
    """Lowering time per node for models with many nodes (median of ``repeats`` runs), and session
    creation for the lowered graphs.

    Two models per count: nodes that share their lowering key (the first is verified and lowered, the
    others get a renamed copy) and nodes that are all different (own inputs, own channel count: every node
    verified and emitted afresh).
    """
    from lowering import lower_model

    def timed(model: onnx.ModelProto) -> tuple[float, onnx.ModelProto]:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            lowered = lower_model(model)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), lowered

    rows = []
    for n in node_counts:
        seconds, lowered = timed(onednn_model(shape, "NCX", TensorProto.FLOAT, nodes=n))
        distinct_seconds, _ = timed(distinct_model(n))
        row = {"nodes": n, "lower_ms": seconds * 1e3, "ms_per_node": seconds * 1e3 / n,
               "distinct_ms_per_node": distinct_seconds * 1e3 / n, "lowered_nodes": len(lowered.graph.node)}
        if n <= 1000:
            options = ort.SessionOptions()
            options.log_severity_level = 4
            t0 = time.perf_counter()
            ort.InferenceSession(lowered.SerializeToString(), options, providers=["CPUExecutionProvider"])
            row["session_ms"] = (time.perf_counter() - t0) * 1e3
        rows.append(row)
    return rows


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import os

    return {"cpu": cpu, "cores": os.cpu_count(), "onnxruntime": ort.__version__, "onnx": onnx.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def run_bench(*, quick: bool = False, shapes: tuple[tuple[int, int], ...] | None = None, batch: int = BATCH,
              reps: int | None = None, layouts=("NCX", "NXC"), dtypes=("f32", "bf16", "f16"),
              pass_nodes: tuple[int, ...] | None = None, use_torch: bool = True, target: str = "onnxruntime",
              runtimes: bool = False,
              progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    shapes = shapes or (QUICK if quick else RESNET50)
    reps = reps or (7 if quick else 11)
    pass_nodes = pass_nodes or ((1, 100, 1000) if quick else (1, 100, 10000))
    torch = _torch() if use_torch else None
    if torch is not None:
        keep_freed_memory()
        torch.set_num_threads(max(1, (machine()["cores"] or 1)))
    if torch is not None:  # torch's first large call in a process runs ~10x slow (thread pool, allocator)
        _warm_torch(torch)
    progress("measuring copy bandwidth ...")
    bandwidth = copy_bandwidth(64 << 20 if quick else 256 << 20)
    progress(f"copy bandwidth {bandwidth:.1f} GB/s")
    cases = []
    total = len(layouts) * len(dtypes) * len(shapes)
    for layout in layouts:
        for dtype in dtypes:
            for channels, size in shapes:
                progress(f"[{len(cases) + 1}/{total}] {layout} {dtype} {channels}x{size}x{size} batch {batch}")
                r = time_case(layout, dtype, channels, size, batch, reps, bandwidth, torch, target)
                cases.append(r)
                extra = f", torch {r.torch_ms:.2f} ms ({r.vs_torch:.2f}x)" if r.torch_ms else ""
                extra += f", peer {r.peer_ms:.2f} ms (peer/oplower {r.peer_speedup:.2f})" if r.peer_ms else ""
                progress(f"    {r.ms:.2f} ms, {r.gbps:.1f} GB/s, {r.vs_bound:.2f}x bound{extra}")
    in_graph = []
    if "f32" in dtypes:
        for layout in layouts:
            for channels, size in shapes:
                progress(f"[in a graph] {layout} f32 {channels}x{size}x{size} batch {batch}, diff_src read by a node")
                row = time_in_graph(layout, channels, size, batch, reps, torch, target)
                in_graph.append(row)
                extra = f", torch + sum {row['torch_ms']:.2f} ms ({row['vs_torch']:.2f}x)" if row["torch_ms"] else ""
                progress(f"    {row['ms']:.2f} ms{extra}")
    runtime_rows = []
    if runtimes:  # one layer (64x56x56 where it is in the workload) in every runtime at hand
        from lowering.bench.runtimes import time_runtimes

        channels, size = (64, 56) if (64, 56) in shapes else shapes[0]
        for layout in layouts:
            progress(f"[runtimes] {layout} f32 {channels}x{size}x{size} batch {batch}, target {target}")
            runtime_rows += time_runtimes(layout, channels, size, batch, reps, target)
    progress("timing the pass ...")
    passes = time_pass(pass_nodes)
    for row in passes:
        progress(f"    {row['nodes']} nodes: {row['ms_per_node']:.3f} ms/node "
                 f"({row['distinct_ms_per_node']:.3f} all distinct)")
    summary = {}
    for layout in layouts:
        for dtype in dtypes:
            sel = [c for c in cases if c.layout == layout and c.dtype == dtype]
            entry = {"geomean_vs_bound": _geomean([c.vs_bound for c in sel])}
            if sel and all(c.vs_torch for c in sel):
                entry["geomean_vs_torch"] = _geomean([c.vs_torch for c in sel])
            if sel and all(c.peer_speedup for c in sel):
                entry["geomean_peer_speedup"] = _geomean([c.peer_speedup for c in sel])
            summary[f"{layout}/{dtype}"] = entry
        sel = [r for r in in_graph if r["layout"] == layout]
        if sel and all(r["vs_torch"] for r in sel):
            summary[f"{layout}/f32 in a graph"] = {"geomean_vs_torch": _geomean([r["vs_torch"] for r in sel])}
    return {"machine": machine(), "target": target, "torch": getattr(torch, "__version__", None),
            "copy_gbps": bandwidth,
            "batch": batch, "reps": reps, "cases": [asdict(c) for c in cases], "in_graph": in_graph,
            "summary": summary, "pass": passes,
            "runtimes": runtime_rows}


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v]
    return float(np.exp(np.mean(np.log(values)))) if values else None


def markdown(result: dict) -> str:
    m = result["machine"]
    torch = result["torch"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores; onnxruntime {m['onnxruntime']}; "
             f"copy bandwidth {result['copy_gbps']:.1f} GB/s; batch {result['batch']}, median of {result['reps']} "
             f"runs; torch {torch or 'not installed'}; target {result.get('target', 'onnxruntime')}.", "",
             "| layout | dtype | C×H×W | ms | GB/s | × bound | torch ms | × torch | peer ms | peer/oplower |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    if any(c.get("peer_ms") for c in result["cases"]):
        lines[1:1] = ["", "peer: PyTorch's decomposition of native_batch_norm_backward exported to ONNX (opset 17) and "
                      "run in the same onnxruntime, f32; peer/oplower > 1 means the lowering is faster."]

    def num(value: float | None) -> str:
        return f"{value:.2f}" if value else "–"

    for c in result["cases"]:
        lines.append(f"| {c['layout']} | {c['dtype']} | {c['channels']}×{c['size']}² | {c['ms']:.2f} | "
                     f"{c['gbps']:.1f} | {c['vs_bound']:.2f} | {num(c['torch_ms'])} | {num(c['vs_torch'])} | "
                     f"{num(c.get('peer_ms'))} | {num(c.get('peer_speedup'))} |")
    if result.get("in_graph"):
        lines += ["", "In a training graph (f32): diff_src read by a ReduceSum instead of being a graph output; "
                  "torch: its backward, then `.sum()` of diff_src.", "",
                  "| layout | C×H×W | ms | torch ms | × torch |", "|---|---|---:|---:|---:|"]
        for r in result["in_graph"]:
            t_ms = f"{r['torch_ms']:.2f}" if r["torch_ms"] else "–"
            t_x = f"{r['vs_torch']:.2f}" if r["vs_torch"] else "–"
            lines.append(f"| {r['layout']} | {r['channels']}×{r['size']}² | {r['ms']:.2f} | {t_ms} | {t_x} |")
    lines += ["", "| layout/dtype | geomean × bound | geomean × torch | geomean peer/oplower |", "|---|---:|---:|---:|"]
    for key, s in result["summary"].items():
        lines.append(f"| {key} | {num(s.get('geomean_vs_bound'))} | {num(s.get('geomean_vs_torch'))} | "
                     f"{num(s.get('geomean_peer_speedup'))} |")
    lines += ["", "| nodes | lower ms | ms/node | ms/node, all distinct | lowered nodes | session ms |",
              "|---:|---:|---:|---:|---:|---:|"]
    for row in result["pass"]:
        session = f"{row['session_ms']:.1f}" if "session_ms" in row else "–"
        lines.append(f"| {row['nodes']} | {row['lower_ms']:.1f} | {row['ms_per_node']:.3f} | "
                     f"{row['distinct_ms_per_node']:.3f} | "
                     f"{row['lowered_nodes']} | {session} |")
    from lowering.bench.runtimes import markdown as runtimes_markdown

    lines += runtimes_markdown(result.get("runtimes", []))
    return "\n".join(lines)
