// Runs a small float16 ONNX graph in the onnxruntime-node that transformers.js 4 loads, on one execution provider,
// every node on that provider (no silent fallback to the CPU provider, which computes float16 ops in float32).
// tests/webgpu.py builds the graphs that show whether a provider computes in float16 (a MatMul's running sum, an
// overflowing product, a rounded sum) and reads the answers.
//
// Usage: node f16_proof.mjs '<json>'   with   {"model": FILE, "device": "webgpu" | "cpu",
//        "inputs": {NAME: {"dims": [..], "bits": B}}}   (float16 inputs, every element the float16 whose bits are B)
// Prints one JSON line: {"device", "outputs": {NAME: [bits, ...]}}, each output element's float16 bits.
import { createRequire } from 'node:module';

const args = JSON.parse(process.argv[2]);
const require = createRequire(import.meta.resolve('tjs4'));  // resolved from transformers.js 4's own folder
const ort = require('onnxruntime-node');

const session = await ort.InferenceSession.create(args.model, {
    executionProviders: [args.device],
    ...(args.device === 'cpu' ? {} : { extra: { session: { disable_cpu_ep_fallback: '1' } } }),
});
const feeds = {};
for (const [name, { dims, bits }] of Object.entries(args.inputs)) {
    feeds[name] = new ort.Tensor('float16', new Uint16Array(dims.reduce((a, b) => a * b, 1)).fill(bits), dims);
}
const results = await session.run(feeds);
const outputs = {};
for (const [name, tensor] of Object.entries(results)) {
    outputs[name] = Array.from(tensor.data);  // float16 data: a Uint16Array of the bits (Node has no Float16Array)
}
await session.release();
console.log(JSON.stringify({ device: args.device, outputs }));
