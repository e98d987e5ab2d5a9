// The browser's twin of clients/js/time_steps.mjs: exported decoder graphs timed against each other in one page, as
// generation runs them: a prefill (the `ids`, no past) and a decode step (one token after a past of `past` tokens),
// on ONNX Runtime Web's WebGPU provider (the build transformers.js 4 bundles). The same feeds as time_steps.mjs
// (positions from 0; the past's keys and values float16 in +-[1/16, 1/8)), so the browser's and Node's figures
// compare. Every graph is opened and warmed by one run of each step (its shaders compiled: `warm_s`, per step), then
// the steps run in rounds, each round every graph once in turn, so that a busy spell on a shared machine slows all
// alike; each round's time is divided by the first graph's (`ratio`).
// URL parameters: models (names served under /models/NAME/, the first the baseline), ids (comma-separated token ids),
// past, rounds. Sets window.halfsafeResult: {adapter, prefill_s: {NAME: [seconds per round]}, decode_s, warm_s:
// {prefill: {NAME: s}, decode}, ratio: {prefill: {NAME: [per round]}, decode}, median: {prefill: {NAME: s}, decode},
// median_ratio, and the steps' shapes: feeds {prefill: {input_ids: dims, ...}, decode}, outputs {NAME: {prefill, decode}}}.
import * as ort from '/node_modules/tjs4/node_modules/onnxruntime-web/dist/ort.webgpu.bundle.min.mjs';

const ONNX_FILE = 'onnx/model_fp16.onnx';  // halfsafe.export.onnx_common.ONNX_FILE
const STEPS = ['decode', 'prefill'];
const params = new URLSearchParams(location.search);
const $ = (id) => document.getElementById(id);
const report = (result) => { window.halfsafeResult = result; $('out').textContent = JSON.stringify(result, null, 1); };
ort.env.wasm.wasmPaths = '/node_modules/tjs4/node_modules/onnxruntime-web/dist/';

function int64(values, dims) {
    return new ort.Tensor('int64', BigInt64Array.from(values.map(BigInt)), dims);
}

function past(heads, length, dim, fill) {
    const data = new Uint16Array(heads * length * dim);
    if (fill) for (let i = 0; i < data.length; i++) data[i] = 0x2c00 | ((i * 2654435761) >>> 22) | ((i & 1) << 15);
    return new ort.Tensor('float16', data, [1, heads, length, dim]);
}

// every input of `session`: the past's heads and head size read from its declared shape [batch, heads, past, dim]
function feeds(session, ids, pastLength) {
    const n = ids.length;
    const all = {
        input_ids: int64(ids, [1, n]),
        attention_mask: int64(new Array(pastLength + n).fill(1), [1, pastLength + n]),
        position_ids: int64(ids.map((_, i) => pastLength + i), [1, n]),
    };
    for (const { name, shape } of session.inputMetadata) {
        if (!name.startsWith('past_key_values')) continue;
        const [, heads, , dim] = shape;
        if (!Number.isInteger(heads) || !Number.isInteger(dim)) throw new Error(`${name}: shape ${shape} has no fixed heads and size`);
        all[name] = past(heads, pastLength, dim, pastLength > 0);
    }
    const missing = session.inputNames.filter((name) => !(name in all));
    if (missing.length) throw new Error(`no feed for the graph's inputs ${missing.join(', ')}`);
    return Object.fromEntries(session.inputNames.map((name) => [name, all[name]]));
}

// what a test checks the steps by: the dims of the ids, the mask, the logits and the first layer's past (or present)
// key, and the first and last position
function shapes(tensors) {
    const out = {};
    for (const [name, t] of Object.entries(tensors)) {
        const key = name.replace(/^(past_key_values|present)\.0\.key$/, 'kv');
        if (['input_ids', 'attention_mask', 'logits', 'kv'].includes(key)) out[key] = t.dims;
    }
    if (tensors.position_ids) out.positions = [tensors.position_ids.data[0], tensors.position_ids.data.at(-1)].map(Number);
    return out;
}

const median = (xs) => { const s = [...xs].sort((a, b) => a - b), m = s.length >> 1; return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2; };
const by = (f) => Object.fromEntries(STEPS.map((step) => [step, f(step)]));

let stage = 'parameters';
try {
    const names = (params.get('models') ?? '').split(',').filter(Boolean);
    const ids = (params.get('ids') ?? '').split(',').filter(Boolean).map(Number);
    const pastLength = Number(params.get('past')), rounds = Number(params.get('rounds') ?? 3);
    if (!names.length || !ids.length || !ids.every(Number.isInteger) || !(Number.isInteger(pastLength) && pastLength > 0)
        || !(Number.isInteger(rounds) && rounds > 0)) {
        throw new Error('give models=NAME,NAME ids=ID,ID,... past=P (at least 1) rounds=N (at least 1)');
    }
    stage = 'adapter';
    const adapter = await navigator.gpu?.requestAdapter();
    if (!adapter) throw new Error('no WebGPU adapter');
    const info = adapter.info ?? {};
    const result = { version: ort.env.versions?.web, prefill: ids.length, past: pastLength, rounds,
                     adapter: { vendor: info.vendor, architecture: info.architecture, description: info.description,
                                shader_f16: adapter.features.has('shader-f16') },
                     prefill_s: {}, decode_s: {}, warm_s: { prefill: {}, decode: {} }, outputs: {} };
    const sessions = [];
    for (const name of names) {
        stage = `load ${name}`;
        const session = await ort.InferenceSession.create(`/models/${name}/${ONNX_FILE}`, { executionProviders: ['webgpu'] });
        const steps = { prefill: feeds(session, ids, 0), decode: feeds(session, ids.slice(0, 1), pastLength) };
        result.feeds ??= by((step) => shapes(steps[step]));
        stage = `warm ${name}`;
        result.outputs[name] = {};
        for (const step of ['prefill', 'decode']) {  // time_steps.mjs's order
            const t = performance.now();
            const out = await session.run(steps[step]);
            result.warm_s[step][name] = (performance.now() - t) / 1000;
            result.outputs[name][step] = shapes(out);
        }
        console.log(`${name}: warm ${JSON.stringify(by((step) => result.warm_s[step][name]))}`);
        result.prefill_s[name] = [];
        result.decode_s[name] = [];
        sessions.push([name, session, steps]);
    }
    for (let r = 0; r < rounds; r++) {
        stage = `round ${r + 1}`;
        for (const step of STEPS) {
            for (const [name, session, steps] of sessions) {
                const t = performance.now();
                await session.run(steps[step]);
                result[`${step}_s`][name].push((performance.now() - t) / 1000);
            }
        }
        console.log(`round ${r + 1}: ${JSON.stringify(by((step) => result[`${step}_s`]))}`);
    }
    for (const [, session] of sessions) await session.release();
    const base = names[0];
    result.ratio = by((step) => Object.fromEntries(names.map((name) => [name, result[`${step}_s`][name].map((t, r) => t / result[`${step}_s`][base][r])])));
    result.median = by((step) => Object.fromEntries(names.map((name) => [name, median(result[`${step}_s`][name])])));
    result.median_ratio = by((step) => Object.fromEntries(names.map((name) => [name, median(result.ratio[step][name])])));
    report(result);
} catch (e) {
    report({ error: String(e.message ?? e), stage });
}
