"""The web UI in headless Chromium (Debian chromium + chromium-driver, driven by selenium) against a live server."""
from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from apitest_support import KEY, LiveServer, sample_files, sqlite_server  # noqa: F401 (fixture)
from ci_rule import missing

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not (CHROMIUM and CHROMEDRIVER):
        reason = "chromium / chromedriver not installed (apt-get install chromium chromium-driver)"
        missing(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


DROP_FILE_JS = """
const [b64, name, target] = arguments;
const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
const transfer = new DataTransfer();
transfer.items.add(new File([bytes], name));
const zone = document.getElementById(target);
for (const type of ["dragover", "drop"]) {
  zone.dispatchEvent(new DragEvent(type, {dataTransfer: transfer, bubbles: true, cancelable: true}));
}
"""


def test_upload_watch_it_finish_and_see_fields_beside_the_page(browser, sqlite_server: LiveServer,
                                                               tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = browser
    # The live list re-renders its rows as statuses change: an element found a moment ago may be replaced before it
    # is read, so a stale reference means "look again", like a missing one.
    from selenium.common.exceptions import StaleElementReferenceException

    wait = WebDriverWait(driver, 90, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))
    driver.get(sqlite_server.base + "/")

    # Without a key the page says in words what to do.
    banner = wait.until(ec.visibility_of_element_located((By.ID, "banner")))
    assert "API key" in banner.text

    driver.find_element(By.ID, "api-key").send_keys(KEY)
    driver.find_element(By.ID, "save-key").click()
    wait.until(ec.invisibility_of_element_located((By.ID, "banner")))
    wait.until(lambda d: len(Select(d.find_element(By.ID, "schema-select")).options) >= 5)
    Select(driver.find_element(By.ID, "schema-select")).select_by_value("receipt")

    samples = [p for p in sample_files() if p.suffix.lower() in (".jpg", ".png", ".pdf", ".tif")]
    assert samples, "samples/ has no image or PDF sample"
    sample = samples[0]
    # Drag and drop, as a person would (a DataTransfer carrying the file, dropped on the zone).
    driver.execute_script(DROP_FILE_JS, base64.b64encode(sample.read_bytes()).decode(), sample.name, "drop-zone")

    # The live list shows the document and its status turns to succeeded.
    row = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#doc-list tr[data-doc-id]")))
    doc_id = row.get_attribute("data-doc-id")
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, f'#doc-list tr[data-doc-id="{doc_id}"] .status').text
               == "succeeded")

    # The detail view: page image beside the extracted fields with confidences.
    wait.until(lambda d: d.find_element(By.ID, "detail-title").get_attribute("data-status") == "succeeded")
    wait.until(lambda d: d.find_element(By.ID, "fields").get_attribute("data-state") == "succeeded")
    wait.until(lambda d: d.execute_script("return document.getElementById('page-image').naturalWidth") > 0)

    def read_fields(d):  # (names, confidences), read in one go from the current DOM
        rows = d.find_elements(By.CSS_SELECTOR, "#field-rows tr.field-row")
        return rows and ([r.find_element(By.CSS_SELECTOR, ".field-name").text for r in rows],
                         [r.find_element(By.CSS_SELECTOR, ".conf").text for r in rows])

    names, confidences = wait.until(read_fields)
    assert "total" in names and any(n.startswith("merchant/") for n in names)
    assert any(c and 0.0 < float(c) <= 1.0 for c in confidences)
    image = driver.find_element(By.ID, "page-image").rect
    fields = driver.find_element(By.ID, "fields").rect
    assert image["x"] + image["width"] <= fields["x"] + 1, (image, fields)  # side by side, image on the left
    assert image["y"] < fields["y"] + fields["height"] and fields["y"] < image["y"] + image["height"]

    shot = tmp_path / "webui-detail.png"
    driver.save_screenshot(str(shot))
    print(f"web UI screenshot: {shot}")
    assert shot.stat().st_size > 10_000

    # A file that is not a document at all is refused at upload: the reason is shown in words, through the
    # file picker this time.
    junk = tmp_path / "not-a-document.pdf"
    junk.write_bytes(b"just some notes, not a PDF " + os.urandom(8).hex().encode())
    driver.find_element(By.ID, "file-input").send_keys(str(junk))
    entry = wait.until(lambda d: next((li for li in d.find_elements(By.CSS_SELECTOR, "#upload-log li")
                                       if li.text.startswith("not-a-document.pdf:") and "uploading" not in li.text),
                                      None))
    assert "could not be read" in entry.text and "error" in entry.get_attribute("class")

    # A PDF by its magic bytes that cannot be rendered is accepted, and fails in its job: the list says
    # failed and the detail view gives the reason in words.
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4\n" + os.urandom(400))
    driver.find_element(By.ID, "file-input").send_keys(str(broken))
    entry = wait.until(lambda d: next((li for li in d.find_elements(By.CSS_SELECTOR, "#upload-log li")
                                       if li.text.startswith("broken.pdf:") and "uploading" not in li.text), None))
    broken_id = entry.text.rsplit(" ", 1)[-1]
    status = f'#doc-list tr[data-doc-id="{broken_id}"] .status'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, status) and
               d.find_element(By.CSS_SELECTOR, status).text == "failed")
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, f'#doc-list tr[data-doc-id="{broken_id}"]').click() or True)
    wait.until(lambda d: "broken.pdf" in d.find_element(By.ID, "detail-error").text)
