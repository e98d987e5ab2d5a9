// Opens an ONNX model in the onnxruntime-node that transformers.js 4 loads, on one execution provider, with ONNX
// Runtime's verbose log on: the log (stderr) lists the provider each node was placed on, "Node(s) placed on [EP]"
// then one "OpType (node name)" line per node. tests/webgpu.py reads it (the nodes left on the CPU provider).
//
// Usage: node placements.mjs '<json>'   with   {"model": FILE, "device": "webgpu"}
import { createRequire } from 'node:module';

const args = JSON.parse(process.argv[2]);
const require = createRequire(import.meta.resolve('tjs4'));  // resolved from transformers.js 4's own folder
const ort = require('onnxruntime-node');

ort.env.logLevel = 'verbose';
const session = await ort.InferenceSession.create(args.model, {
    executionProviders: [args.device], logSeverityLevel: 0, logVerbosityLevel: 0,
});
await session.release();
console.log(JSON.stringify({ device: args.device, model: args.model }));
