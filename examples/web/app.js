// Loads the served model folder with transformers.js (served from node_modules by serve.py) and generates greedily.
// URL parameters: model (folder name under /models/, default "model"), lib ("tjs4" or "tjs3"), device ("wasm" or
// "webgpu"; default webgpu where the browser has it), prompt and tokens (then it generates at once, for tests),
// check=logits (with prompt: first one forward pass over the prompt, its logits reported: all finite?, the last
// position's argmax; then the generation as usual).
// When done it sets window.halfsafeResult (the prompt's tokens, the generated text, times) for a test to read.
const params = new URLSearchParams(location.search);
const lib = params.get('lib') ?? 'tjs4';
const modelName = params.get('model') ?? 'model';
const device = params.get('device') ?? ('gpu' in navigator ? 'webgpu' : 'wasm');
const $ = (id) => document.getElementById(id);

// the ONNX Runtime Web build each version bundles: its .wasm files are served locally too
const WASM = { tjs3: '/node_modules/tjs3/dist/', tjs4: '/node_modules/tjs4/node_modules/onnxruntime-web/dist/' };
const { env, pipeline } = await import(`/node_modules/${lib}/dist/transformers.js`);
env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = '/models/';
env.useBrowserCache = false;
env.backends.onnx.wasm.wasmPaths = WASM[lib];
$('model').textContent = modelName;
$('version').textContent = env.version;
$('device').textContent = device;

const report = (result) => { window.halfsafeResult = result; };
let generator;
try {
    const t0 = performance.now();
    generator = await pipeline('text-generation', modelName, { device });
    report.load_s = (performance.now() - t0) / 1000;
    $('out').textContent = `loaded in ${report.load_s.toFixed(1)} s`;
    $('run').disabled = false;
} catch (e) {
    $('out').textContent = `loading failed: ${e.message ?? e}`;
    report({ error: String(e.message ?? e), stage: 'load', version: env.version, device });
}

async function generate() {
    const prompt = $('prompt').value;
    const new_tokens = Number($('tokens').value);
    const tokenizer = generator.tokenizer;
    // the special-token rule of the text-generation pipeline, to report the prompt's tokens as it encodes them
    const special = (tokenizer.add_bos_token || tokenizer.add_eos_token) ?? false;
    const prompt_ids = Array.from(tokenizer.encode(prompt, { add_special_tokens: special }));
    $('out').textContent = 'generating ...';
    try {
        const logits = params.get('check') === 'logits' ? await checkLogits(tokenizer, prompt, special) : undefined;
        const t0 = performance.now();
        const [out] = await generator(prompt, { max_new_tokens: new_tokens, min_new_tokens: new_tokens, do_sample: false, return_full_text: false });
        const seconds = (performance.now() - t0) / 1000;
        $('out').textContent = prompt + out.generated_text + `\n\n(${new_tokens} tokens in ${seconds.toFixed(1)} s)`;
        report({ prompt_ids, text: out.generated_text, generate_s: seconds, load_s: report.load_s, version: env.version, device, logits });
    } catch (e) {
        $('out').textContent = `generation failed: ${e.message ?? e}`;
        report({ error: String(e.message ?? e), stage: 'generate', version: env.version, device });
    }
}

// one forward pass of the model over the prompt: are all its logits finite (a float16 overflow makes them inf/NaN),
// and the last position's argmax
async function checkLogits(tokenizer, prompt, special) {
    const { logits } = await generator.model(tokenizer(prompt, { add_special_tokens: special }));
    const [, length, vocab] = logits.dims;
    const last = logits.data.subarray((length - 1) * vocab, length * vocab);
    let argmax = 0;
    for (let i = 1; i < vocab; i++) if (last[i] > last[argmax]) argmax = i;
    return { dtype: logits.type, dims: logits.dims, finite: Array.prototype.every.call(logits.data, Number.isFinite), argmax };
}

$('run').addEventListener('click', generate);
if (generator && params.has('prompt')) {
    $('prompt').value = params.get('prompt');
    if (params.has('tokens')) $('tokens').value = params.get('tokens');
    await generate();
}
