"""The operator console in a real browser: Debian's Chromium driven by Playwright.

Run by tests/suite/console.rs against a real `tollgate serve` whose admin listener has a token
and whose bucket `per_key` the test drained over gRPC (descriptor api_key=demo, domain edge).
Each check prints a line; the first failure raises (exit status 1) with what was seen.

Environment:
  ADMIN        the admin listener, http://127.0.0.1:PORT
  TOKEN        its admin.token
  SHOTS        a directory for the screenshots docs/console.md shows
  CHROMIUM     the browser (default /usr/bin/chromium)
"""

import json
import os
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from playwright.sync_api import sync_playwright

ADMIN = os.environ["ADMIN"].rstrip("/")
TOKEN = os.environ["TOKEN"]
SHOTS = os.environ["SHOTS"]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
DEEP_LINK = ADMIN + "/explain?domain=edge&descriptor=api_key=demo"


def check(condition, what, seen=""):
    if not condition:
        raise AssertionError(f"{what}; seen: {seen}")
    print(f"ok: {what}", flush=True)


def peek_tokens():
    """The drained bucket's tokens, read through the JSON API with the bearer token."""
    body = json.dumps({"domain": "edge", "descriptor": [{"key": "api_key", "value": "demo"}]}).encode()
    request = urllib.request.Request(
        ADMIN + "/v1/buckets/peek",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=10) as answer:
        return json.load(answer)["buckets"][0]["tokens"]


def shot(page, name):
    page.screenshot(path=os.path.join(SHOTS, name), full_page=True)


def token_flow(page):
    page.goto(ADMIN + "/")
    check(page.url.startswith(ADMIN + "/login"), "without a session the console sends the browser to /login", page.url)
    shot(page, "login.png")
    page.fill("#token", "not-the-token")
    page.click("form.login button[type=submit]")
    page.wait_for_selector("form.login output:has-text('wrong token')")
    check(page.url.startswith(ADMIN + "/login"), "a wrong token opens no session", page.url)
    page.fill("#token", TOKEN)
    page.click("form.login button[type=submit]")
    page.wait_for_selector("form.login output:has-text('less than a second ago')")
    check(page.url.startswith(ADMIN + "/login"), "right after a failure, even the token waits a second")
    page.wait_for_timeout(1100)
    page.click("form.login button[type=submit]")
    page.wait_for_url(ADMIN + "/")
    check(page.locator("h1").inner_text() == "Overview", "the right token opens the overview")
    cookies = [c for c in page.context.cookies() if c["name"].startswith("tollgate_admin_session")]
    check(len(cookies) == 1, "a session cookie is set", cookies)
    check(cookies[0]["httpOnly"] and cookies[0]["sameSite"] == "Strict", "it is HttpOnly and SameSite=Strict", cookies)
    check(TOKEN not in cookies[0]["value"], "it is not the token")
    check(page.evaluate("document.cookie") == "", "no script can read it")


def overview(page):
    page.goto(ADMIN + "/")
    rules = page.locator("section.domain[data-domain=edge] table.rules").inner_text()
    check("api_key" in rules and "tenant" in rules, "the overview lists the domain's rules", rules)
    buckets = page.locator("section.domain[data-domain=edge] table.buckets").inner_text()
    check("per_key" in buckets and "business_hours" in buckets, "and its buckets", buckets)
    check(page.locator("svg#rates polyline.decisions").count() == 1, "the traffic chart is drawn")
    box = page.locator("svg#rates").bounding_box()
    check(box is not None and box["width"] > 300 and box["height"] > 60, "at a visible size", box)
    points = page.locator("svg#rates polyline.denials").get_attribute("points") or ""
    check(len(points.split()) >= 2, "with a line of denials", points)
    denied = page.locator("#denied").inner_text()
    check("per_key" in denied and "demo" not in denied, "the most-denied buckets name per_key, its value masked", denied)
    shot(page, "overview.png")


def explain(page):
    page.goto(DEEP_LINK)
    verdict = page.locator("#verdict").inner_text()
    check(verdict == "OVER_LIMIT", "the deep link for the drained bucket says OVER_LIMIT", verdict)
    deciding = page.locator("#deciding-bucket").inner_text()
    check(deciding == "per_key", "and names the bucket", deciding)
    check(page.locator("#tokens-left").inner_text() == "0", "with no token left")
    passes = page.locator("#passes-in").inner_text()
    check(passes.startswith("It passes in ") and passes.endswith(" s."), "and says when it passes", passes)
    shot(page, "explain.png")
    before = peek_tokens()
    page.reload()
    check(page.locator("#verdict").inner_text() == "OVER_LIMIT" and peek_tokens() == before == 0,
          "a second explain leaves the bucket as it was", before)
    page.click("a.bucket-actions")
    page.wait_for_url("**/bucket?*")
    check(page.locator("#buckets tr[data-bucket=per_key] td.tokens").inner_text().startswith("0 /"),
          "the explain page links to the bucket's actions, which peek it")


def bucket_actions(page):
    page.fill("#refund input[name=tokens]", "2")
    page.click("#refund button.ask")
    check(page.locator("#refund .confirm").is_visible(), "a refund asks for a confirmation first")
    check(peek_tokens() == 0, "nothing is sent before it")
    page.click("#refund button.cancel")
    check(not page.locator("#refund .confirm").is_visible() and peek_tokens() == 0, "cancel sends nothing")
    page.press("#refund input[name=tokens]", "Enter")
    check(page.locator("#refund .confirm").is_visible() and peek_tokens() == 0, "Enter in the field does not skip it")
    shot(page, "bucket.png")
    with page.expect_navigation():
        page.click("#refund button.yes")
    check(peek_tokens() == 2, "the confirmed refund gives 2 tokens back", peek_tokens())
    flash = page.locator("#flash").inner_text()
    check(flash == "Refunded: per_key 2 of 3 tokens.", "and the page says what the API answered", flash)
    page.click("#reset button.ask")
    with page.expect_navigation():
        page.click("#reset button.yes")
    check(peek_tokens() == 3, "the confirmed reset fills the bucket", peek_tokens())


def timeline(page):
    page.goto(ADMIN + "/timeline?domain=edge&rule=tenant")
    card = page.locator("section.timeline[data-bucket=business_hours]")
    check(card.count() == 1, "the timeline shows the rule's bucket")
    capacity = card.locator("svg polyline.capacity").get_attribute("points") or ""
    check(len(capacity.split()) > 4, "its capacity over 7 days changes with the schedule", capacity)
    changes = card.locator("table.changes").inner_text()
    check("50" in changes and "100" in changes and ("EST" in changes or "EDT" in changes),
          "its changes are listed in New York time", changes)
    shot(page, "timeline.png")
    page.goto(ADMIN + "/timeline?domain=edge&bucket=daily")
    resets = page.locator("ul.resets li").count()
    check(resets == 7, "a daily quota resets 7 times in 7 days", resets)


def cross_site(browser):
    """A page of another site (localhost is not 127.0.0.1) tries to reset and to read."""
    port_holder = {}
    admin = ADMIN

    class Attacker(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            page = f"""<!doctype html><html><body>
<form id=f method=post action="{admin}/v1/buckets/reset" enctype="text/plain" target=sink>
<input name='{{"domain":"edge","descriptor":[{{"key":"api_key","value":"demo"}}],"x":"' value='"}}'></form>
<iframe name=sink></iframe>
<script>
window.results = {{}};
async function go() {{
  const body = JSON.stringify({{domain: "edge", descriptor: [{{key: "api_key", value: "demo"}}]}});
  try {{ await fetch("{admin}/v1/buckets/reset", {{method: "POST", mode: "no-cors", credentials: "include",
        headers: {{"Content-Type": "text/plain"}}, body}}); window.results.simple = "sent"; }}
  catch (e) {{ window.results.simple = "refused"; }}
  try {{ const r = await fetch("{admin}/v1/buckets/reset", {{method: "POST", credentials: "include",
        headers: {{"Content-Type": "application/json"}}, body}}); window.results.json = "status " + r.status; }}
  catch (e) {{ window.results.json = "refused"; }}
  try {{ const r = await fetch("{admin}/explain?domain=edge&descriptor=api_key=demo", {{credentials: "include"}});
        window.results.read = await r.text(); }}
  catch (e) {{ window.results.read = "refused"; }}
  document.getElementById("f").submit();
  window.results.done = true;
}}
go();
</script></body></html>"""
            data = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Attacker)
    port_holder["port"] = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        before = peek_tokens()
        check(before == 0, "the bucket is still drained, so a reset would show", before)
        # The same browser context: it holds the operator's session cookie.
        page = browser.new_page()
        page.goto(f"http://localhost:{port_holder['port']}/")
        page.wait_for_function("window.results && window.results.done === true")
        page.wait_for_timeout(1000)
        results = page.evaluate("window.results")
        check(results["json"] == "refused", "a cross-site JSON POST is stopped at its preflight", results)
        check(results["read"] == "refused", "a cross-site page cannot read a console page", results)
        check(peek_tokens() == before, "and neither a simple POST nor a form resets the bucket", (before, peek_tokens()))
        page.close()
    finally:
        server.shutdown()


def logout(page):
    page.goto(ADMIN + "/")
    with page.expect_navigation():
        page.click("form.logout button")
    check(page.url.startswith(ADMIN + "/login"), "logout returns to the login page", page.url)
    page.goto(ADMIN + "/explain")
    check(page.url.startswith(ADMIN + "/login"), "and the session is over", page.url)


def main():
    os.makedirs(SHOTS, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1200, "height": 900}, device_scale_factor=1)
        page = context.new_page()
        seen = []
        page.on("request", lambda r: seen.append(r.url))
        token_flow(page)
        overview(page)
        explain(page)
        cross_site(context)
        bucket_actions(page)
        timeline(page)
        elsewhere = [u for u in seen if not u.startswith(ADMIN + "/")]
        check(seen and not elsewhere, f"no request left the admin listener ({len(seen)} requests)", elsewhere)
        logout(page)
        browser.close()
    print("all browser checks passed", flush=True)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
