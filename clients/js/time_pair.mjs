// Times exported decoder folders against each other in one Node process, fairly on a machine shared with other
// work: every folder is loaded with transformers.js on `device` and warmed by one forward (its shaders compiled),
// then the forwards run in rounds, each round every folder once in turn, so that a busy spell slows all alike.
//
// Usage: node time_pair.mjs '<json>'   with   {"folders": [DIR, ...], "lib": "tjs4", "ids": [..], "rounds": N,
//        "device": "webgpu" (optional)}
// Prints one JSON line: {"forward_s": {DIR: [seconds per round, ...]}, "warm_s": {DIR: seconds}}.
import path from 'node:path';

const args = JSON.parse(process.argv[2]);
const { env, AutoModelForCausalLM, Tensor } = await import(args.lib);
env.allowRemoteModels = false;
env.allowLocalModels = true;

const ids = new Tensor('int64', BigInt64Array.from(args.ids.map(BigInt)), [1, args.ids.length]);
const mask = new Tensor('int64', new BigInt64Array(args.ids.length).fill(1n), [1, args.ids.length]);
const inputs = { input_ids: ids, attention_mask: mask };
const models = [];
const out = { forward_s: {}, warm_s: {} };
for (const folder of args.folders) {
    env.localModelPath = path.dirname(path.resolve(folder)) + path.sep;
    const model = await AutoModelForCausalLM.from_pretrained(path.basename(path.resolve(folder)),
        args.device ? { device: args.device } : {});
    const t = performance.now();
    await model(inputs);
    out.warm_s[folder] = (performance.now() - t) / 1000;
    out.forward_s[folder] = [];
    models.push([folder, model]);
}
for (let r = 0; r < args.rounds; r++) {
    for (const [folder, model] of models) {
        const t = performance.now();
        await model(inputs);
        out.forward_s[folder].push((performance.now() - t) / 1000);
    }
}
for (const [, model] of models) await model.dispose();
console.log(JSON.stringify(out));
