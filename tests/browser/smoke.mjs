// Open Lab 1 in a real JupyterLab in headless Chromium, run every cell, and check that a
// matplotlib plot and an ipywidgets control render. Saves a screenshot.
// Usage: node smoke.mjs URL SCREENSHOT [TIMEOUT_S]   (run.sh starts JupyterLab and calls this)
import { chromium } from "playwright-core";

const [url, screenshot, timeoutArg] = process.argv.slice(2);
const timeoutMs = Number(timeoutArg ?? 600) * 1000;
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
let failed = "";
try {
  await page.goto(url, { waitUntil: "domcontentloaded" });
  await page.waitForSelector(".jp-Notebook .jp-CodeCell", { timeout: 180_000 });
  // the kernel must be connected and idle, or Run All's requests go nowhere
  await page.waitForFunction(() => /\|\s*Idle/.test(document.body.innerText), null, { timeout: 180_000 });
  await page.click("li.lm-MenuBar-item:has-text('Run')", { timeout: 30_000 });
  await page.click("li.lm-Menu-item:has-text('Run All Cells')", { timeout: 30_000 });
  await page.waitForFunction(() => [...document.querySelectorAll(".jp-CodeCell .jp-InputArea-prompt")]
    .some((p) => /\[(\*|\d+)\]/.test(p.textContent)), null, { timeout: 60_000 });
  const start = Date.now();
  await page.waitForFunction(() => {
    const prompts = [...document.querySelectorAll(".jp-CodeCell .jp-InputArea-prompt")].map((p) => p.textContent);
    const running = prompts.some((t) => t.includes("*"));
    const lastDone = prompts.length > 0 && /\[\d+\]/.test(prompts[prompts.length - 1]);
    const traceback = [...document.querySelectorAll(".jp-OutputArea-output")].some((o) => o.textContent.includes("Traceback"));
    return !running && (lastDone || traceback);
  }, null, { timeout: timeoutMs, polling: 2000 });
  const tracebacks = await page.locator(".jp-OutputArea-output", { hasText: "Traceback" }).count();
  const plots = await page.locator(".jp-RenderedImage img").count();
  const sliders = await page.locator(".jupyter-widgets .widget-slider, .widget-hslider").count();
  console.log(`ran in ${((Date.now() - start) / 1000).toFixed(0)} s: ${plots} plots, ${sliders} widget sliders, ${tracebacks} tracebacks`);
  if (plots < 1) failed += "no plot rendered; ";
  if (sliders < 1) failed += "no widget rendered; ";
  if (tracebacks > 0) {
    const first = page.locator(".jp-OutputArea-output", { hasText: "Traceback" }).first();
    failed += `${tracebacks} cells raised: ${(await first.textContent()).slice(-600)}; `;
    await first.scrollIntoViewIfNeeded();
  }
  const widget = page.locator(".widget-hslider").first();
  if (!tracebacks && await widget.count()) await widget.scrollIntoViewIfNeeded();
} catch (err) {
  failed += String(err);
}
await page.screenshot({ path: screenshot });
console.log(`screenshot: ${screenshot}`);
await browser.close();
if (failed) {
  console.error(`browser smoke test FAILED: ${failed}`);
  process.exit(1);
}
console.log("browser smoke test passed");
