"""The browser page (web/) trains a train-step model in a real headless Chromium with stock onnxruntime-web
(wasm): its per-step losses and final parameters equal the Python Trainer's.

Needs Debian's ``chromium`` and ``npm ci`` in web/ (the pinned onnxruntime-web); ``.ci/run`` installs both and
sets OPLOWER_BROWSER_TEST=required, where a missing piece fails the test instead of skipping it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from lowering.cli import main
from lowering.training.trainer import train

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "web"
ARTIFACTS = ROOT / "tests" / "fixtures" / "ort_training" / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ORT_WEB = WEB / "node_modules" / "onnxruntime-web" / "dist" / "ort.wasm.min.js"
MISSING = ("Debian's chromium (apt-get install chromium)" if CHROMIUM is None else
           "onnxruntime-web (cd web && npm ci)" if not ORT_WEB.exists() else None)
REQUIRED = os.environ.get("OPLOWER_BROWSER_TEST") == "required"  # CI: a missing piece fails, never skips
pytestmark = pytest.mark.skipif(MISSING is not None and not REQUIRED,
                                reason=f"the browser test needs {MISSING}; .ci/run installs it and sets "
                                       "OPLOWER_BROWSER_TEST=required")
STEPS = 20


class _Handler(SimpleHTTPRequestHandler):
    """Serves the repository's web/ at / and the bundle at /bundle/; the page POSTs its result to /report."""

    def __init__(self, *args, bundle: Path, result: dict, done: threading.Event, **kwargs):
        self.bundle, self.result, self.done = bundle, result, done
        super().__init__(*args, directory=str(WEB), **kwargs)

    def translate_path(self, path: str) -> str:
        if path.startswith("/bundle/"):
            return str(self.bundle / path[len("/bundle/"):].split("?")[0])
        return super().translate_path(path)

    def do_POST(self) -> None:  # noqa: N802 -- http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.result.update(json.loads(body))
        self.send_response(204)
        self.end_headers()
        self.done.set()

    def end_headers(self) -> None:
        if self.path.endswith(".mjs"):
            self.send_header("Content-Type", "text/javascript")
        super().end_headers()

    def log_message(self, *args) -> None:
        pass


def _browser_run(bundle: Path, tmp_path: Path) -> dict:
    assert MISSING is None, f"OPLOWER_BROWSER_TEST=required, but the test needs {MISSING}"
    result: dict = {}
    done = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, bundle=bundle, result=result, done=done))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}/index.html?bundle=/bundle/&report=/report"
    browser = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert done.wait(timeout=240), "the page reported nothing within 240 s"
    finally:
        browser.kill()
        browser.wait()
        server.shutdown()
        server.server_close()
    assert "error" not in result, result.get("error")
    return result


@pytest.mark.parametrize("name, made_by_oplower", [("cnn", False), ("mlp_l1", False), ("cnn", True)],
                         ids=["cnn", "mlp_l1", "cnn-oplower-artifacts"])  # AdamW with batch norm; SGD; our own
def test_browser_trains_like_the_python_trainer(name, made_by_oplower, tmp_path):
    directory = ARTIFACTS / name
    meta = json.loads((directory / "meta.json").read_text())
    if made_by_oplower:  # the artifacts `oplower artifacts` makes from the torch export train there unchanged
        assert main(["artifacts", str(directory / "forward_model.onnx"), "-o", str(tmp_path / "made"), "--loss",
                     meta["loss"], "--optimizer", meta["optimizer"]]) == 0
        directory = tmp_path / "made"
    data = dict(np.load(ARTIFACTS / name / "data.npz"))
    data[meta["labels_input"]] = data.pop("labels")
    np.savez(tmp_path / "data.npz", **data)
    params = dict(np.load(ARTIFACTS / name / "initial_params.npz"))
    bundle = tmp_path / "bundle"
    assert main(["train-step", str(directory), "--bundle", str(bundle), "--data", str(tmp_path / "data.npz"),
                 "--params", str(ARTIFACTS / name / "initial_params.npz"), "--steps", str(STEPS),
                 "--lr", str(meta["learning_rate"])]) == 0
    got = _browser_run(bundle, tmp_path)
    losses, final = train(directory, data, STEPS, params=params, learning_rate=meta["learning_rate"])
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-4)
    curve = json.loads((ARTIFACTS / name / "api_curve.json").read_text())["loss"]  # onnxruntime-training's own
    np.testing.assert_allclose(got["losses"], curve, rtol=1e-4)
    for p, value in final.items():
        np.testing.assert_allclose(np.asarray(got["params"][p], np.float64), value.reshape(-1), rtol=1e-4,
                                   atol=1e-6, err_msg=p)
    assert got["checksum"] == pytest.approx(sum(float(v.astype(np.float64).sum()) for v in final.values()),
                                            rel=1e-5, abs=1e-6)
