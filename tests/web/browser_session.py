"""One session of a real headless Chromium against the web console, driven by Debian's
python3-selenium and chromium-driver (run by /usr/bin/python3: tests/web/
test_console_browser.py starts it and checks what it prints).

    browser_session.py CONSOLE_URL TOKEN KEY ATTACKER_URL SCREENSHOT

Prints one JSON object of what it saw, step by step.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By


def wait(driver: Any, done: Callable[[], bool], timeout: float = 20) -> None:
    """Until `done()` (a page loaded after a click), or fail saying so."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if done():
                return
        except WebDriverException:
            pass  # the page is being replaced
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out on {driver.current_url}: {driver.title}")
        time.sleep(0.1)


def main() -> None:
    url, token, key, attacker, screenshot = sys.argv[1:6]
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                "--disable-dev-shm-usage", "--no-first-run"):
        options.add_argument(arg)
    options.binary_location = "/usr/bin/chromium"
    service = Service(executable_path="/usr/bin/chromedriver")
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    seen: dict[str, object] = {}
    try:
        driver.get(url + "/")
        seen["redirected_to_login"] = driver.current_url.endswith("/login")
        driver.find_element(By.NAME, "token").send_keys(token)
        driver.find_element(By.CSS_SELECTOR, "form.login button").click()
        # A click on a submit button does not wait for the page it loads: wait for it.
        wait(driver, lambda: driver.title.startswith(("Overview", "Refused")))
        seen["overview_title"] = driver.title
        seen["overview"] = driver.find_element(By.TAG_NAME, "main").text[:300]
        cookies = {c["name"]: c for c in driver.get_cookies()}
        session = cookies.get("perfectsched_session") or {}
        seen["cookie"] = {"httpOnly": session.get("httpOnly"),
                          "sameSite": session.get("sameSite")}

        # Find the schedule by its prefix.
        driver.find_element(By.LINK_TEXT, "Schedules").click()
        box = driver.find_element(By.NAME, "prefix")
        box.send_keys(key[:4])
        driver.find_element(By.CSS_SELECTOR, "form.filters button").click()
        wait(driver, lambda: "prefix=" in driver.current_url)
        links = [a.text for a in driver.find_elements(By.CSS_SELECTOR, "table a")]
        seen["found"] = links
        driver.find_element(By.LINK_TEXT, key).click()
        wait(driver, lambda: driver.title.startswith(key))
        seen["schedule_title"] = driver.title

        # A change without the CSRF token: the form's hidden field taken out.
        driver.execute_script(
            "document.querySelectorAll('input[name=csrf]').forEach(e => e.remove())")
        driver.find_element(By.CSS_SELECTOR, "button[value=pause]").click()
        wait(driver, lambda: driver.title.startswith("Refused"))
        seen["without_csrf"] = driver.find_element(By.TAG_NAME, "main").text

        # Pause, then run now, as a user would.
        driver.get(url + "/schedules/" + key)
        driver.find_element(By.CSS_SELECTOR, "button[value=pause]").click()
        wait(driver, lambda: "paused" in driver.find_element(By.TAG_NAME, "main").text
             .split("\n")[0])
        seen["after_pause"] = driver.find_element(By.TAG_NAME, "main").text
        driver.find_element(By.CSS_SELECTOR, "button[value=run]").click()
        wait(driver, lambda: ": run: " in driver.find_element(By.TAG_NAME, "main").text)
        deadline = time.monotonic() + 30
        runs_text = ""
        while time.monotonic() < deadline:
            driver.get(url + "/schedules/" + key)
            tables = driver.find_elements(By.CSS_SELECTOR, "main table")
            runs_text = tables[-1].text if tables else ""
            if "success" in runs_text or "failed" in runs_text:
                break
            time.sleep(0.5)
        for summary in driver.find_elements(By.TAG_NAME, "summary"):
            summary.click()  # open each run's output
        seen["runs"] = driver.find_elements(By.CSS_SELECTOR, "main table")[-1].text
        seen["outputs"] = [p.text for p in driver.find_elements(By.TAG_NAME, "pre")]
        try:
            driver.switch_to.alert  # noqa: B018 - raises when no alert is open
            seen["alert"] = True
        except NoAlertPresentException:
            seen["alert"] = False
        driver.set_window_size(1280, 1700)
        driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(screenshot)

        # On a phone's screen: nothing wider than the screen (tables scroll in boxes).
        driver.set_window_size(390, 844)
        for page in ("/", "/schedules", "/schedules/" + key):
            driver.get(url + page)
            seen.setdefault("phone_overflow", {})[page] = driver.execute_script(  # type: ignore[index]
                "return document.documentElement.scrollWidth - window.innerWidth")
        driver.set_window_size(1280, 900)

        # A page of another origin that posts a form to the console on its own.
        driver.get(attacker)
        time.sleep(2)
        seen["forged"] = driver.find_element(By.TAG_NAME, "body").text
        driver.get(url + "/schedules/" + key)
        seen["after_forged"] = driver.find_element(By.TAG_NAME, "main").text
    except Exception:
        print(json.dumps(seen), file=sys.stderr)  # how far it got
        raise
    finally:
        driver.quit()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
