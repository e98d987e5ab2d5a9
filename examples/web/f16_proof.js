// The float16 proof of the page's WebGPU adapter (f16_proof.html): a WGSL compute shader in f16 whose inputs come
// from a storage buffer (so the compiler folds nothing) computes what float16 and float32 answer differently.
// Sets window.halfsafeResult: the adapter's info and features, and each output as float16 bits (inf survives JSON).
const K = 4096;  // an f16 running sum of K ones stalls at 2048
const SMALL = 0.0004;  // under half of f16's spacing at 1: 1 + SMALL rounds to 1
const NAMES = ['sum_of_ones', 'product', 'product_over_300', 'one_plus_small', 'one_plus_small_minus_one'];
const SHADER = `
enable f16;
@group(0) @binding(0) var<storage, read> inp: array<f16>;  // 300, 1, SMALL, (unused), then K ones
@group(0) @binding(1) var<storage, read_write> out: array<f16>;
@compute @workgroup_size(1) fn main() {
  var sum = 0.0h;
  for (var i = 0u; i < ${K}u; i++) { sum += inp[4u + i]; }
  let product = inp[0] * inp[0];
  let one_plus_small = inp[1] + inp[2];
  out[0] = sum; out[1] = product; out[2] = product / inp[0]; out[3] = one_plus_small; out[4] = one_plus_small - inp[1];
}`;

function halfBits(x) {  // round to nearest even, for the normal numbers used here
    const f = new Float32Array([x]), u = new Uint32Array(f.buffer)[0];
    const sign = (u >>> 16) & 0x8000, exp = ((u >>> 23) & 0xff) - 127 + 15, mant = u & 0x7fffff;
    let h = sign | (exp << 10) | (mant >>> 13);
    const rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest === 0x1000 && (h & 1))) h += 1;
    return h;
}

const $ = (id) => document.getElementById(id);
const report = (result) => { window.halfsafeResult = result; $('out').textContent = JSON.stringify(result, null, 1); };
let result = { stage: 'adapter' };
try {
    if (!('gpu' in navigator)) throw new Error('no navigator.gpu: WebGPU is off in this browser');
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) throw new Error('requestAdapter() gave no adapter');
    const info = adapter.info ?? {};
    result = {
        stage: 'device',
        adapter: { vendor: info.vendor, architecture: info.architecture, device: info.device, description: info.description,
                   fallback: info.isFallbackAdapter ?? adapter.isFallbackAdapter ?? null },
        features: [...adapter.features].sort(),
        shader_f16: adapter.features.has('shader-f16'),
    };
    if (!result.shader_f16) throw new Error("the adapter has no 'shader-f16'");
    const device = await adapter.requestDevice({ requiredFeatures: ['shader-f16'] });
    result.stage = 'shader';
    const input = new Uint16Array(4 + K).fill(halfBits(1));
    input.set([halfBits(300), halfBits(1), halfBits(SMALL)]);
    const inp = device.createBuffer({ size: input.byteLength, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST });
    device.queue.writeBuffer(inp, 0, input);
    const size = 16;  // 5 f16 outputs, padded to a multiple of 4 bytes
    const out = device.createBuffer({ size, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC });
    const read = device.createBuffer({ size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    device.pushErrorScope('validation');
    const pipeline = device.createComputePipeline({ layout: 'auto', compute: { module: device.createShaderModule({ code: SHADER }), entryPoint: 'main' } });
    const bind = device.createBindGroup({ layout: pipeline.getBindGroupLayout(0), entries: [
        { binding: 0, resource: { buffer: inp } }, { binding: 1, resource: { buffer: out } }] });
    const encoder = device.createCommandEncoder();
    const pass = encoder.beginComputePass();
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, bind);
    pass.dispatchWorkgroups(1);
    pass.end();
    encoder.copyBufferToBuffer(out, 0, read, 0, size);
    device.queue.submit([encoder.finish()]);
    const error = await device.popErrorScope();
    if (error) throw new Error(error.message);
    await read.mapAsync(GPUMapMode.READ);
    const bits = new Uint16Array(read.getMappedRange().slice(0));
    result.bits = Object.fromEntries(NAMES.map((name, i) => [name, bits[i]]));
    delete result.stage;
    report(result);
} catch (e) {
    report({ ...result, error: String(e.message ?? e) });
}
