// Drives dcp serve's page (GET /) in Debian's headless chromium through playwright-core: types a prompt, picks a
// policy and budget, presses Generate and checks that the text streams in (several updates of the output), that
// it equals the API's answer for the same request, and that the page shows the bytes the cache held.
// Usage: node check_page.mjs URL SCREENSHOT.png. Exit 0 ok, 1 failure, 77 chromium cannot start (a skip).
import { chromium } from 'playwright-core';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const [url, shot] = process.argv.slice(2);
if (!url || !shot) { console.error('usage: node check_page.mjs URL SCREENSHOT.png'); process.exit(2); }
const executablePath = process.env.CHROMIUM || '/usr/bin/chromium';
const profile = mkdtempSync(join(tmpdir(), 'dcp-chromium-'));
let context;
try {
  context = await chromium.launchPersistentContext(profile, {
    executablePath, headless: true, timeout: 60000,
    args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
           '--no-first-run'],
  });
} catch (e) {
  console.log(`SKIP: chromium (${executablePath}) cannot start: ${e.message.split('\n')[0]}`);
  rmSync(profile, { recursive: true, force: true });
  process.exit(77);
}
let failed = null;
try {
  const page = context.pages()[0] || await context.newPage();
  page.setDefaultTimeout(30000);
  await page.goto(url);
  await page.fill('#prompt', 'The cache of a language model ');
  await page.selectOption('#policy', 'window');
  await page.selectOption('#budget', '0.5');
  await page.fill('#max_tokens', '120');
  await page.fill('#temperature', '0.8');
  await page.fill('#seed', '7');
  // Count the updates of the output while it streams: one mutation record per change of the text (a callback may
  // carry several: when the server is faster than the browser, many events arrive in one network read and are
  // applied in one task; a page that waited for the whole answer would still show one record).
  await page.evaluate(() => {
    window.__updates = 0;
    new MutationObserver((records) => { window.__updates += records.length; })
      .observe(document.getElementById('output'), { childList: true, characterData: true, subtree: true });
  });
  await page.click('#go');
  await page.waitForFunction(() => document.getElementById('status').textContent.startsWith('done:'));
  const text = await page.textContent('#output');
  const updates = await page.evaluate(() => window.__updates);
  const status = await page.textContent('#status');
  const kv = await page.textContent('#kv');
  const api = await (await fetch(new URL('/v1/completions', url), {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompt: 'The cache of a language model ', max_tokens: 120, temperature: 0.8, seed: 7,
                           kv_policy: 'window', kv_budget: 0.5 }),
  })).json();
  await page.screenshot({ path: shot, fullPage: true });
  if (text.length === 0) failed = 'no text appeared';
  else if (updates < 3) failed = `the text came in ${updates} update(s), not streamed`;
  else if (text !== api.choices[0].text) failed = `the page shows ${JSON.stringify(text)}, the API answers ${JSON.stringify(api.choices[0].text)}`;
  else if (!/ B| kB| MB/.test(kv)) failed = `the cache's bytes are not shown (${kv})`;
  else if (!status.includes('window at 0.5')) failed = `the status does not name the policy: ${status}`;
  console.log(`page: ${text.length} characters in ${updates} updates; ${status}; KV ${kv}; screenshot ${shot}`);
} catch (e) {
  failed = e.message;
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
if (failed) { console.log(`FAIL: ${failed}`); process.exit(1); }
console.log('page ok');
