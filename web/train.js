// Trains the bundle named by ?bundle=URL/ (bundle.json, tensors.bin, train_step.onnx; see
// lowering/web_bundle.py) for its step count, draws the loss curve and shows a checksum of the final
// parameters. With ?report=URL it POSTs {losses, checksum, params} there as JSON (the test harness).
"use strict";

const ARRAYS = {float32: Float32Array, int64: BigInt64Array, int32: Int32Array, bool: Uint8Array};

function tensorOf(blob, meta) {
  const Kind = ARRAYS[meta.dtype];
  const view = new Kind(blob, meta.offset, meta.bytes / Kind.BYTES_PER_ELEMENT);
  return new ort.Tensor(meta.dtype, view.slice(), meta.shape);  // a copy: tensors own their data
}

function batchOf(blob, meta, k) {
  // data arrays carry a leading batch-index axis: step k feeds index k mod B
  const [count, ...shape] = meta.shape;
  const Kind = ARRAYS[meta.dtype];
  const per = meta.bytes / count;
  const view = new Kind(blob, meta.offset + (k % count) * per, per / Kind.BYTES_PER_ELEMENT);
  return new ort.Tensor(meta.dtype, view.slice(), shape);
}

function checksum(state, names) {
  // sum of every parameter entry in float64, parameters in bundle order
  let total = 0;
  for (const name of names) for (const v of state[name].data) total += v;
  return total;
}

function draw(losses) {
  const canvas = document.getElementById("curve");
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const lo = Math.min(...losses), hi = Math.max(...losses), span = hi - lo || 1;
  g.beginPath();
  losses.forEach((loss, i) => {
    const x = 10 + (canvas.width - 20) * (losses.length > 1 ? i / (losses.length - 1) : 0);
    const y = canvas.height - 10 - (canvas.height - 20) * (loss - lo) / span;
    if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
  });
  g.strokeStyle = "#06c";
  g.stroke();
}

async function train() {
  const query = new URLSearchParams(location.search);
  const base = query.get("bundle") || "bundle/";
  const report = query.get("report");
  const status = document.getElementById("status");
  try {
    ort.env.wasm.numThreads = 1;  // no cross-origin isolation needed
    ort.env.wasm.wasmPaths = new URL("node_modules/onnxruntime-web/dist/", location.href).href;
    const index = await (await fetch(base + "bundle.json")).json();
    const blob = await (await fetch(base + index.tensors)).arrayBuffer();
    const model = await (await fetch(base + index.model)).arrayBuffer();
    const session = await ort.InferenceSession.create(model, {executionProviders: ["wasm"]});
    const state = {}, constants = {};
    for (const [name, meta] of Object.entries(index.state)) state[name] = tensorOf(blob, meta);
    for (const [name, meta] of Object.entries(index.constants)) constants[name] = tensorOf(blob, meta);
    const lr = new ort.Tensor("float32", Float32Array.of(index.learning_rate), [1]);
    const losses = [];
    const started = performance.now();
    for (let k = 0; k < index.steps; k++) {
      const feeds = {...constants, ...state, learning_rate: lr,
                     step: new ort.Tensor("int64", BigInt64Array.of(BigInt((index.first_step || 1) + k)), [1])};
      for (const [name, meta] of Object.entries(index.data)) feeds[name] = batchOf(blob, meta, k);
      const out = await session.run(feeds);
      losses.push(Number(out[index.loss].data[0]));
      for (const name of Object.keys(state)) state[name] = out[name + ".updated"];
      status.textContent = `step ${k + 1} of ${index.steps}: loss ${losses[k].toPrecision(6)}`;
      draw(losses);
    }
    const ms = (performance.now() - started) / index.steps;
    const params = index.params;
    const sum = checksum(state, params);
    document.getElementById("steps").textContent = index.steps;
    document.getElementById("first").textContent = losses[0].toPrecision(8);
    document.getElementById("last").textContent = losses[losses.length - 1].toPrecision(8);
    document.getElementById("ms").textContent = ms.toFixed(2);
    document.getElementById("checksum").textContent = sum.toPrecision(12);
    status.textContent = `trained ${index.steps} steps`;
    if (report) {
      const finals = {};
      for (const name of params) finals[name] = Array.from(state[name].data, Number);
      await fetch(report, {method: "POST", headers: {"Content-Type": "application/json"},
                           body: JSON.stringify({losses, checksum: sum, params: finals})});
    }
  } catch (error) {
    status.textContent = `error: ${error.message || error}`;
    status.className = "error";
    if (report) await fetch(report, {method: "POST", body: JSON.stringify({error: String(error.message || error)})});
  }
}

train();
