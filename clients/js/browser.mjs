// Opens a page in headless Chromium (Debian's /usr/bin/chromium, driven by playwright-core) and prints, as one JSON
// line, what the page puts in window.halfsafeResult, with the console messages and page errors.
// Usage: node browser.mjs URL [timeout_ms] [chromium] [wasm|webgpu]
// wasm (the default): no GPU at all. webgpu: WebGPU on whatever Vulkan driver this process's environment names
// (scripts/install-browser-webgpu: lavapipe under SwiftShader's ids, and a chromium copy without SwiftShader), the
// environment passed on to the browser; --use-angle=vulkan is needed beside --enable-unsafe-webgpu.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { chromium } from 'playwright-core';

const [url, timeout = '300000', executablePath = '/usr/bin/chromium', mode = 'wasm'] = process.argv.slice(2);
if (!['wasm', 'webgpu'].includes(mode)) throw new Error(`mode must be wasm or webgpu, not ${mode}`);
const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'halfsafe-chromium-'));
const quiet = ['--disable-background-networking', '--disable-component-update', '--no-first-run', '--disable-sync'];
const args = mode === 'webgpu'
    ? ['--headless=new', '--no-sandbox', '--enable-unsafe-webgpu', '--use-angle=vulkan', ...quiet]
    : ['--headless', '--no-sandbox', '--disable-gpu', ...quiet];
const env = mode === 'webgpu' ? { ...process.env } : undefined;
const context = await chromium.launchPersistentContext(profile, { executablePath, headless: true, args, env });
const logs = [];
try {
    const page = context.pages()[0] ?? await context.newPage();
    page.on('console', (m) => logs.push(`${m.type()}: ${m.text()}`));
    page.on('pageerror', (e) => logs.push(`pageerror: ${e.message}`));
    await page.goto(url);
    await page.waitForFunction(() => window.halfsafeResult !== undefined, null, { timeout: Number(timeout), polling: 200 });
    const result = await page.evaluate(() => window.halfsafeResult);
    console.log(JSON.stringify({ result, logs }));
} catch (e) {
    console.log(JSON.stringify({ result: { error: String(e.message ?? e), stage: 'browser' }, logs }));
} finally {
    await context.close();
    fs.rmSync(profile, { recursive: true, force: true });
}
