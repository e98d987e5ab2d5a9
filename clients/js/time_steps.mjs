// Times exported decoder graphs against each other in one Node process, as generation runs them: a prefill (PREFILL
// tokens, no past) and a decode step (one token after a past of PAST tokens), on one ONNX Runtime provider
// (onnxruntime-node, the one transformers.js 4 uses). Every graph is opened and warmed by one run of each step (its
// shaders compiled), then the steps run in rounds, each round every graph once in turn, so that a busy spell on a
// shared machine slows all alike.
//
// Usage: node time_steps.mjs '<json>'   with   {"models": {NAME: FILE}, "device": "webgpu" | "cpu", "threads": N
//        (optional: the CPU provider's intra-op threads), "ids": [PREFILL token ids], "past": PAST, "rounds": N,
//        "kv": {"heads": H, "dim": D, "layers": [INPUT NAME, ...]}}
// The past's keys and values are float16 values in +-[1/16, 1/8) (what they hold does not change the work done).
// Prints one JSON line: {"prefill_s": {NAME: [seconds per round]}, "decode_s": {...}, "warm_s": {NAME: seconds}}.
import { createRequire } from 'node:module';

const fromTjs4 = createRequire(new URL('./node_modules/tjs4/package.json', import.meta.url));
const ort = fromTjs4('onnxruntime-node');

const args = JSON.parse(process.argv[2]);
const { heads, dim, layers } = args.kv;

function int64(values, dims) {
    return new ort.Tensor('int64', BigInt64Array.from(values.map(BigInt)), dims);
}

function past(length, fill) {
    const data = new Uint16Array(heads * length * dim);
    if (fill) for (let i = 0; i < data.length; i++) data[i] = 0x2c00 | ((i * 2654435761) >>> 22) | ((i & 1) << 15);
    return new ort.Tensor('float16', data, [1, heads, length, dim]);
}

function feeds(names, ids, pastLength) {
    const n = ids.length;
    const all = {
        input_ids: int64(ids, [1, n]),
        attention_mask: int64(new Array(pastLength + n).fill(1), [1, pastLength + n]),
        position_ids: int64(ids.map((_, i) => pastLength + i), [1, n]),
    };
    for (const name of layers) all[name] = past(pastLength, pastLength > 0);
    return Object.fromEntries(names.map((name) => [name, all[name]]));
}

const options = { executionProviders: [args.device] };
if (args.threads) Object.assign(options, { intraOpNumThreads: args.threads, interOpNumThreads: 1 });
const sessions = [];
const out = { prefill_s: {}, decode_s: {}, warm_s: {} };
for (const [name, file] of Object.entries(args.models)) {
    const session = await ort.InferenceSession.create(file, options);
    const steps = {
        prefill: feeds(session.inputNames, args.ids, 0),
        decode: feeds(session.inputNames, args.ids.slice(0, 1), args.past),
    };
    const t = performance.now();
    for (const step of Object.values(steps)) await session.run(step);
    out.warm_s[name] = (performance.now() - t) / 1000;
    out.prefill_s[name] = [];
    out.decode_s[name] = [];
    sessions.push([name, session, steps]);
}
for (let r = 0; r < args.rounds; r++) {
    for (const step of ['decode', 'prefill']) {
        for (const [name, session, steps] of sessions) {
            const t = performance.now();
            await session.run(steps[step]);
            out[`${step}_s`][name].push((performance.now() - t) / 1000);
        }
    }
}
for (const [, session] of sessions) await session.release();
console.log(JSON.stringify(out));
