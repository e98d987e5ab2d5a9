// Runs an exported ONNX folder with transformers.js in Node, as a user would: from the local file system, no
// options beyond the task (dtype and KV-cache dtype come from the folder's config.json).
//
// Usage: node run.mjs '<json>'   with   {"folder": DIR, "lib": "tjs3" | "tjs4", "prompt": TEXT, "ids": [..],
//        "new_tokens": N, "forwards": N (optional), "task": "text-generation" | "text2text-generation" | "feature-extraction" | "fill-mask",
//        "logits_out": FILE, "pipeline_out": FILE (optional), "device": "webgpu" (optional: ONNX Runtime's WebGPU
//        provider, onnxruntime-node's in Node; the caller sets up the Vulkan driver it runs on, scripts/install-webgpu)}
// Prints one JSON line: the library version, the prompt's tokens as the pipeline encodes them, the pipeline's
// generated text, the greedy tokens of generate() after `ids`, and the logits of one forward pass over `ids`
// (dtype, dims, finite; all of them written to `logits_out` as little-endian float32 when given). For
// text2text-generation, generate()'s tokens start with the decoder start token, and the forward pass takes them
// as the decoder's input. For the encoder tasks (feature-extraction, fill-mask) there is no generate(): the pipeline's
// result (fill-mask: its predictions; feature-extraction: the tensor's dims, its data written to `pipeline_out`) and
// one forward pass of the model over `ids` (its logits or last_hidden_state, as `logits`).
import fs from 'node:fs';
import path from 'node:path';

const args = JSON.parse(process.argv[2]);
const lib = await import(args.lib);
const { env, pipeline, AutoTokenizer, Tensor } = lib;
env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = path.dirname(path.resolve(args.folder)) + path.sep;
const id = path.basename(path.resolve(args.folder));
const task = args.task ?? 'text-generation';
const seq2seq = task === 'text2text-generation';
const encoderOnly = task === 'feature-extraction' || task === 'fill-mask';
const out = { lib: args.lib, version: env.version, device: args.device ?? 'default' };
const t0 = performance.now();

const greedy = { max_new_tokens: args.new_tokens, min_new_tokens: args.new_tokens, do_sample: false };
const pipe = await pipeline(task, id, args.device ? { device: args.device } : {});
out.load_s = (performance.now() - t0) / 1000;
if (args.prompt !== undefined) {
    const tokenizer = pipe.tokenizer;
    // the rule the text-generation pipeline applies (seq2seq pipelines always add the special tokens)
    const special = seq2seq || encoderOnly ? true : ((tokenizer.add_bos_token || tokenizer.add_eos_token) ?? false);
    out.prompt_ids = Array.from(tokenizer.encode(args.prompt, { add_special_tokens: special }));
    const t = performance.now();
    if (encoderOnly) {
        const result = await pipe(args.prompt, task === 'fill-mask' ? { top_k: 5 } : { pooling: 'none', normalize: false });
        out.pipeline_s = (performance.now() - t) / 1000;
        if (task === 'fill-mask') {
            out.pipeline_result = result.map(({ score, token, token_str }) => ({ score, token, token_str }));
        } else {
            out.pipeline_result = { dtype: result.type, dims: result.dims, finite: Array.prototype.every.call(result.data, Number.isFinite) };
            if (args.pipeline_out) fs.writeFileSync(args.pipeline_out, Buffer.from(result.data.buffer, result.data.byteOffset, result.data.byteLength));
        }
    } else {
        const result = await pipe(args.prompt, seq2seq ? greedy : { ...greedy, return_full_text: false });
        out.pipeline_s = (performance.now() - t) / 1000;
        out.pipeline_text = result[0].generated_text;
    }
}

const model = pipe.model;
if (args.ids) {
    const ids = new Tensor('int64', BigInt64Array.from(args.ids.map(BigInt)), [1, args.ids.length]);
    const mask = new Tensor('int64', new BigInt64Array(args.ids.length).fill(1n), [1, args.ids.length]);
    let generated;
    if (!encoderOnly && (args.new_tokens > 0 || seq2seq)) {  // new_tokens 0: the forward pass only
        const t = performance.now();
        generated = await model.generate({ input_ids: ids, attention_mask: mask, ...greedy });
        out.generate_s = (performance.now() - t) / 1000;
        const all = Array.from(generated.data, Number);
        out.generate_ids = seq2seq ? all : all.slice(args.ids.length);
    }
    // one forward pass over `ids` (an encoder-decoder's: `ids` encoded, the generated tokens as decoder input)
    const inputs = seq2seq ? { input_ids: ids, attention_mask: mask, decoder_input_ids: generated }
        : { input_ids: ids, attention_mask: mask };
    // `forwards` > 1: the pass repeated, each timed (the first after generate() has compiled the shaders)
    out.forward_s = [];
    let outputs;
    for (let i = 0; i < (args.forwards ?? 1); i++) {
        const t = performance.now();
        outputs = await model(inputs);
        out.forward_s.push((performance.now() - t) / 1000);
    }
    const logits = outputs.logits ?? outputs.last_hidden_state;
    const data = logits.data;
    out.logits = { dtype: logits.type, dims: logits.dims, finite: Array.prototype.every.call(data, Number.isFinite) };
    if (args.logits_out && data instanceof Float32Array) {
        fs.writeFileSync(args.logits_out, Buffer.from(data.buffer, data.byteOffset, data.byteLength));
    }
}
out.total_s = (performance.now() - t0) / 1000;
await model.dispose();
console.log(JSON.stringify(out));
