// Opens a page in headless Chromium (Debian's /usr/bin/chromium, driven by playwright-core) and prints, as one JSON
// line, what the page puts in window.halfsafeResult, with the console messages and page errors.
// Usage: node browser.mjs URL [timeout_ms] [chromium]
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { chromium } from 'playwright-core';

const [url, timeout = '300000', executablePath = '/usr/bin/chromium'] = process.argv.slice(2);
const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'halfsafe-chromium-'));
const args = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
    '--no-first-run', '--disable-sync'];
const context = await chromium.launchPersistentContext(profile, { executablePath, headless: true, args });
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
