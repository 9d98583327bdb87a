"""A headless browser for the dashboard's tests."""

import shutil

import pytest


def chromium_driver():
    """Headless Chromium through chromium-driver (Debian packages; `make test` installs them when
    it runs as root)."""
    chromedriver, chromium = shutil.which("chromedriver"), shutil.which("chromium")
    if not (chromedriver and chromium):
        pytest.skip(
            "Chromium is not installed (Debian packages chromium, chromium-driver; `make test` "
            "installs them when run as root)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(chromedriver), options=options)
