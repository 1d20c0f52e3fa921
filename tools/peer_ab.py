"""oplower against the peer (needs torch) on issue 15's five ResNet-50 layers, two runners only, and op profiles.

Needs torch (the peer is PyTorch's decomposition exported to ONNX, lowering/bench/peer.py); never imported by
the package or the tests. `oplower bench` times the same layers with torch's fused kernel as a third runner;
this harness leaves torch's OpenMP threads out of the rounds, so the two onnxruntime sessions alternate alone.

    python tools/peer_ab.py                    # f32, batch 32, both layouts, 31 interleaved runs per layer
    python tools/peer_ab.py --repeat 3         # the whole table three times (ratios move run to run)
    python tools/peer_ab.py --profile NXC:2048:7   # onnxruntime's per-kernel medians, oplower and the peer
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import tempfile

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from lowering.bench import PAUSE, _busy_wait, _interleaved, _median_ms, _peer_runner, keep_freed_memory, lowered_model
from lowering.bench import peer as peer_module
from runtime.session import PreparedModel

LAYERS = ((64, 56), (256, 56), (512, 28), (1024, 14), (2048, 7))
BATCH = 32


def _tensors(layout: str, channels: int, size: int):
    shape = (BATCH, channels, size, size) if layout == "NCX" else (BATCH, size, size, channels)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    return shape, x, dy, np.ones(channels, np.float32)


def ab(torch, reps: int) -> None:
    for layout in ("NCX", "NXC"):
        ratios = []
        for channels, size in LAYERS:
            shape, x, dy, vec = _tensors(layout, channels, size)
            ours = PreparedModel(lowered_model(shape, layout, TensorProto.FLOAT), allow_spinning=False)
            ours.bind({"src": x, "diff_dst": dy, "mean": vec * 0, "variance": vec, "gamma": vec},
                      {"diff_src_0": np.empty_like(x), "diff_gamma_0": np.empty_like(vec),
                       "diff_beta_0": np.empty_like(vec)})
            times = _interleaved({"oplower": ours.run_bound, "peer": _peer_runner(torch, x, dy, layout)}, reps)
            mine, theirs = _median_ms(times["oplower"]), _median_ms(times["peer"])
            ratios.append(theirs / mine)
            print(f"| {layout} | {channels}×{size}² | {mine:.2f} | {theirs:.2f} | {theirs / mine:.2f} |", flush=True)
        print(f"| {layout} | geomean | | | {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f} |", flush=True)


def _profiled_session(model, feeds: dict, outputs: list[np.ndarray]):
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "profile")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    for out, array in zip(session.get_outputs(), outputs, strict=True):
        binding.bind_output(out.name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
    return session, binding


def _kernel_medians(session, runs: int) -> tuple[float, dict[str, tuple[str, float]]]:
    path = session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    durations, kinds, model_runs = collections.defaultdict(list), {}, []
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            name = event["name"][: -len("_kernel_time")]
            durations[name].append(event["dur"])
            kinds[name] = event["args"]["op_name"]
        elif event.get("name") == "model_run":
            model_runs.append(event["dur"])
    kernels = {name: (kinds[name], float(np.median(d[-runs:])) / 1000) for name, d in durations.items()}
    return float(np.median(model_runs[-runs:])) / 1000, kernels


def profile(torch, spec: str, runs: int) -> None:
    """Both sessions profiled while they alternate (busy pauses, IOBinding into preallocated outputs), so each
    run starts with the caches the other left, as in the A/B; back to back, the inputs stay in cache."""
    layout, channels, size = spec.split(":")
    shape, x, dy, vec = _tensors(layout, int(channels), int(size))
    keep = [np.empty_like(x), np.empty_like(vec), np.empty_like(vec), np.empty_like(x), np.empty_like(vec),
            np.empty_like(vec)]
    sessions = {
        "oplower": _profiled_session(lowered_model(shape, layout, TensorProto.FLOAT),
                                     {"src": x, "diff_dst": dy, "mean": vec * 0, "variance": vec, "gamma": vec},
                                     keep[:3]),
        "peer": _profiled_session(peer_module.peer_model(torch, shape, layout),
                                  dict(zip(peer_module.PEER_INPUTS, (dy, x, vec, vec * 0, vec), strict=True)),
                                  keep[3:]),
    }
    order = list(sessions.values())
    for round_ in range(5 + runs):
        for session, binding in order if round_ % 2 else order[::-1]:
            _busy_wait(PAUSE)
            session.run_with_iobinding(binding)
    for label, (session, _) in sessions.items():
        model_run, kernels = _kernel_medians(session, runs)
        rows = sorted(kernels.items(), key=lambda item: -item[1][1])
        big = [(name, kind, ms) for name, (kind, ms) in rows if ms >= 0.05]
        small = [ms for _, (_, ms) in rows if ms < 0.05]
        print(f"{label}: model_run {model_run:.2f} ms; {len(kernels)} kernels, sum of medians "
              f"{sum(ms for _, (_, ms) in rows):.2f} ms")
        for name, kind, ms in big:
            print(f"  {ms:7.3f} ms  {kind:20s} {name}")
        print(f"  {sum(small):7.3f} ms  {len(small)} kernels under 0.05 ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=31, help="interleaved runs per layer (default 31)")
    parser.add_argument("--repeat", type=int, default=1, help="how many times to time the whole table")
    parser.add_argument("--profile", metavar="LAYOUT:C:S", help="profile one layer instead, e.g. NXC:2048:7")
    args = parser.parse_args()
    import torch

    keep_freed_memory()
    torch.set_num_threads(2)
    if args.profile:
        profile(torch, args.profile, args.reps)
        return
    for _ in range(args.repeat):
        print("| layout | C×H×W | oplower ms | peer ms | peer/oplower |\n|---|---|---:|---:|---:|", flush=True)
        ab(torch, args.reps)


if __name__ == "__main__":
    main()
