// Runs small ONNX graphs with onnxruntime-node (the one transformers.js 4 uses in Node) on one execution provider,
// to compare single ops with halfsafe's emulation of that provider's arithmetic.
//
// Usage: node ort_op.mjs '<json>'   with   {"device": "webgpu" | "cpu", "runs": [{"model": FILE,
//        "inputs": {NAME: {"file": FILE, "dtype": "float16" | "float32" | "int64", "dims": [..]}},
//        "out": DIR}], "optimized": FILE (optional: the first run's graph as the provider optimized it),
//        "verbose": true (optional: ONNX Runtime's verbose log on stderr, which prints each WebGPU shader)}
// Input files hold the raw little-endian values; each output is written to DIR/<name>.bin the same way.
// Prints one JSON line per run: the outputs' dtype and dims, and the run's seconds (session creation included).
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';

// transformers.js 4's own onnxruntime-node (the top-level one belongs to transformers.js 3)
const fromTjs4 = createRequire(new URL('./node_modules/tjs4/package.json', import.meta.url));
const ort = fromTjs4('onnxruntime-node');

const ARRAYS = { float16: Uint16Array, float32: Float32Array, int64: BigInt64Array, int32: Int32Array };
const args = JSON.parse(process.argv[2]);
if (args.verbose) ort.env.logLevel = 'verbose';

function tensor({ file, dtype, dims }) {
    const bytes = fs.readFileSync(file);
    const Array_ = ARRAYS[dtype];
    const copy = new Uint8Array(bytes.byteLength);  // aligned for the typed array
    copy.set(bytes);
    return new ort.Tensor(dtype, new Array_(copy.buffer), dims);
}

for (const [i, run] of args.runs.entries()) {
    const t0 = performance.now();
    const options = { executionProviders: [args.device ?? 'webgpu'] };
    if (args.verbose) Object.assign(options, { logSeverityLevel: 0, logVerbosityLevel: 0 });
    if (i === 0 && args.optimized) options.optimizedModelFilePath = args.optimized;
    const session = await ort.InferenceSession.create(run.model, options);
    const feeds = Object.fromEntries(Object.entries(run.inputs).map(([name, spec]) => [name, tensor(spec)]));
    const results = await session.run(feeds);
    fs.mkdirSync(run.out, { recursive: true });
    const outputs = {};
    for (const [name, t] of Object.entries(results)) {
        const data = t.data;
        fs.writeFileSync(path.join(run.out, `${name}.bin`), Buffer.from(data.buffer, data.byteOffset, data.byteLength));
        outputs[name] = { dtype: t.type, dims: t.dims };
    }
    await session.release();
    console.log(JSON.stringify({ model: run.model, outputs, seconds: (performance.now() - t0) / 1000 }));
}
