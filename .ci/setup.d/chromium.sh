# Debian's chromium for tests/system/test_browser.py (the MLflow UI rendered by a real, headless browser).
ci_up_chromium() {
    if ! command -v chromium >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
    fi
    chromium --version 2>/dev/null | head -1 || true
}

ci_down_chromium() { :; }
