"""JupyterLab on a scratch copy of the repository, driven by Debian's headless Chromium.

Nothing here downloads a browser or a driver: Selenium gets the driver's path explicitly,
so Selenium Manager never runs. Every wait is bounded.
"""
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_HINT = "apt-get install -y --no-install-recommends chromium chromium-driver"
SERVER_START_SECONDS = 90
SERVER_STOP_SECONDS = 20
# JupyterLab renders an error output (and plain stderr) with this mime type; only an
# error carries the traceback header.
STDERR_OUTPUT = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
CODE_PROMPTS = ".jp-Notebook .jp-CodeCell .jp-InputArea-prompt"
EXECUTION_INDICATOR = ".jp-Notebook-ExecutionIndicator"
DIALOG = ".jp-Dialog"
CURRENT_TAB = ".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-current"
# The Run menu's "Run All Cells" item (it runs notebook:run-all-cells on the current notebook).
RUN_ALL_COMMAND = "runmenu:run-all"
# Only the JupyterLab settings that would reach the network or cover the page with a toast.
QUIET_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
}


class BrowserTestError(AssertionError):
    """A step of the browser test did not happen in time or as expected."""


def missing_browser() -> str | None:
    """Why Chromium cannot be driven here, or None when it can."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        return f"missing {', '.join(missing)}: as root, `apt-get update && {INSTALL_HINT}`"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: `.venv/bin/python -m pip install -r .ci/requirements-test.txt`"
    return None


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise BrowserTestError(f"git {' '.join(args)} failed in {repo}: {proc.stderr.strip()}")
    return proc.stdout


def copy_checkout(source: Path, dest: Path, configure=None) -> Path:
    """Copy the working tree's tracked and not-ignored files of `source` into a new git
    repository `dest`, run `configure(dest)` (e.g. git filters) and commit them there."""
    names = _git(source, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    dest.mkdir(parents=True)
    for name in filter(None, names):
        src = source / name
        if not src.is_file() or src.is_symlink():
            continue  # deleted in the working tree, a submodule, or a link (e.g. .venv)
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name)
    _git(dest, "init", "-q")
    _git(dest, "config", "user.name", "Lab test")
    _git(dest, "config", "user.email", "lab-test@localhost")
    _git(dest, "config", "commit.gpgsign", "false")
    if configure is not None:
        configure(dest)
    _git(dest, "add", "--all")
    _git(dest, "commit", "-q", "-m", "scratch copy of the working tree")
    return dest


def git_status(repo: Path, *paths: str) -> str:
    """`git status --porcelain` of `repo`, or of `paths` in it (empty when clean)."""
    return _git(repo, "status", "--porcelain", "--", *paths)


def git_diff(repo: Path, path: str) -> str:
    """`git diff` of `path` in `repo`: the working file through its clean filter against the index."""
    return _git(repo, "diff", "--", path)


def git_add(repo: Path, path: str) -> None:
    _git(repo, "add", "--", path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LabServer:
    """`make lab`'s command on a free port with a random token, with every Jupyter
    directory in `state_dir` so that the user's settings, kernels' profiles and
    workspaces neither leak in nor get written."""

    def __init__(self, repo: Path, state_dir: Path):
        self.repo = repo
        self.state_dir = state_dir
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.log_path = state_dir / "jupyterlab.log"
        self.runtime_dir = state_dir / "runtime"
        self.proc = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _environment(self) -> dict:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JUPYTER", "IPYTHON", "MPL")) and k != "PYTHONSTARTUP"}
        dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data", "JUPYTER_RUNTIME_DIR": "runtime",
                "JUPYTERLAB_SETTINGS_DIR": "settings", "JUPYTERLAB_WORKSPACES_DIR": "workspaces",
                "IPYTHONDIR": "ipython", "MPLCONFIGDIR": "matplotlib"}
        for var, sub in dirs.items():
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
            env[var] = str(self.state_dir / sub)
        for name, values in QUIET_SETTINGS.items():
            path = self.state_dir / "settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values), encoding="utf-8")
        return env

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "jupyterlab", "--notebook-dir=notebooks", "--no-browser",
               f"--port={self.port}", f"--IdentityProvider.token={self.token}",
               "--ServerApp.port_retries=0"]  # never drift to another port than the one polled
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        return cmd

    def _request(self, path: str, method: str = "GET", timeout: float = 5):
        req = urllib.request.Request(self.base_url + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()

    def sessions(self) -> list[dict]:
        """The server's notebook sessions (path, kernel and its execution_state)."""
        try:
            return json.loads(self._request("/api/sessions")[1])
        except (urllib.error.URLError, OSError, ValueError):
            return []

    def delete_session(self, session_id: str) -> None:
        """Shut the session's kernel down, as closing a notebook and its kernel does."""
        self._request(f"/api/sessions/{session_id}", method="DELETE", timeout=30)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> "LabServer":
        env = self._environment()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), cwd=self.repo, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrowserTestError(f"JupyterLab exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self._request("/api/status")[0] == 200:
                    return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise BrowserTestError(f"JupyterLab did not answer within {SERVER_START_SECONDS} s:\n{self.log_tail()}")

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}{path}{sep}token={self.token}"

    def stop(self) -> None:
        """Ask the server to shut its kernels and itself down; then kill its process group,
        and any kernel left (kernels run in sessions of their own), by process id."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self._request("/api/shutdown", method="POST")
            except (urllib.error.URLError, OSError):
                pass
            try:
                self.proc.wait(timeout=SERVER_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                continue
        for pid in self.kernel_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None

    def kernel_pids(self) -> list[int]:
        """Processes whose command line names a connection file in this server's runtime dir."""
        marker = str(self.runtime_dir).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if marker in (entry / "cmdline").read_bytes():
                        pids.append(int(entry.name))
                except OSError:
                    continue
        return pids


def start_chromium(profile_dir: Path, width: int = 1400, height: int = 1600):
    """Headless Chromium through chromedriver, both Debian's, both given by path."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", f"--user-data-dir={profile_dir}",
                "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(profile_dir.parent / "chromedriver.log"))
    return webdriver.Chrome(options=options, service=service)


def wait_for(condition, seconds: float, what, poll: float = 0.25):
    """Call `condition()` until it returns something truthy; after `seconds`, fail naming
    `what` (a string, or a function giving one, called then for the state at that moment)."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BrowserTestError(f"{what() if callable(what) else what}: not within {seconds:g} s")
        time.sleep(poll)


class NotebookPage:
    """One notebook open in JupyterLab, in a workspace of its own (no tabs restored)."""

    def __init__(self, driver, server: LabServer, name: str):
        self.driver = driver
        self.server = server
        self.name = name

    def open(self, seconds: float = 60) -> "NotebookPage":
        from selenium.webdriver.common.by import By

        workspace = re.sub(r"[^a-z0-9]+", "-", self.name.lower())
        self.driver.get(self.server.url(f"/lab/workspaces/{workspace}/tree/{self.name}?reset"))
        wait_for(lambda: self.driver.find_elements(By.CSS_SELECTOR, CODE_PROMPTS), seconds,
                 f"{self.name}: no code cell shown")
        # The page reads "idle" before any kernel is attached: wait for the server's session too.
        wait_for(lambda: self.kernel_state() == "idle" and self.kernel_status() == "idle" and not self.dialog_text(),
                 seconds, lambda: f"{self.name}: kernel {self.kernel_state()} on the server, {self.kernel_status()} "
                                  f"in the page after opening{self.dialog_note()}")
        return self

    def dialog_text(self) -> str:
        """Text of an open dialog (it would be waiting for the user), or ""."""
        from selenium.webdriver.common.by import By

        return " | ".join(e.text.replace("\n", " ") for e in self.driver.find_elements(By.CSS_SELECTOR, DIALOG))

    def dialog_note(self) -> str:
        text = self.dialog_text()
        return f"; a dialog is open: {text}" if text else ""

    def session(self) -> dict | None:
        """The server's session for this notebook, with its kernel, or None."""
        for session in self.server.sessions():
            if session.get("path") == self.name and session.get("kernel"):
                return session
        return None

    def kernel_state(self) -> str | None:
        """The execution state of this notebook's kernel as the server reports it, or None."""
        session = self.session()
        return session["kernel"].get("execution_state") if session else None

    def shutdown_kernel(self) -> None:
        """Stop this notebook's kernel, so that each notebook's kernel holds memory only while it runs."""
        session = self.session()
        if session:
            self.server.delete_session(session["id"])

    def kernel_status(self) -> str | None:
        """The kernel status shown by the notebook's toolbar."""
        from selenium.webdriver.common.by import By

        found = self.driver.find_elements(By.CSS_SELECTOR, EXECUTION_INDICATOR)
        return found[0].get_attribute("data-status") if found else None

    def prompts(self) -> list[str]:
        from selenium.webdriver.common.by import By

        return [e.get_attribute("textContent").strip()
                for e in self.driver.find_elements(By.CSS_SELECTOR, CODE_PROMPTS)]

    def stderr_outputs(self) -> list[str]:
        """Texts of the outputs shown as stderr: errors and anything printed to stderr."""
        from selenium.webdriver.common.by import By

        return [e.get_attribute("textContent") for e in self.driver.find_elements(By.CSS_SELECTOR, STDERR_OUTPUT)]

    def error_outputs(self) -> list[str]:
        """Texts of the error outputs shown in the page."""
        return [t for t in self.stderr_outputs() if "Traceback" in t]

    def run_all_cells(self) -> None:
        """Run → Run All Cells, clicked as a person would."""
        from selenium.webdriver.common.by import By

        menu = wait_for(lambda: [e for e in self.driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item")
                                 if e.text.strip() == "Run"], 10, "no Run menu")
        menu[0].click()
        item = wait_for(lambda: self.driver.find_elements(
            By.CSS_SELECTOR, f'.lm-Menu-item[data-command="{RUN_ALL_COMMAND}"]'), 10, "no Run All Cells item")
        item[0].click()

    def wait_until_finished(self, seconds: float) -> list[str]:
        """Wait until the kernel is idle and no cell is running or queued, twice in a row
        (the kernel is briefly idle between two queued cells); return the prompts."""
        stable = []

        def finished():
            prompts = self.prompts()
            done = (self.kernel_status() == "idle" and self.kernel_state() == "idle" and "[*]:" not in prompts
                    and (all(re.fullmatch(r"\[\d+\]:", p) for p in prompts) or self.error_outputs()))
            stable.append(bool(done))
            return prompts if stable[-2:] == [True, True] else None

        return wait_for(finished, seconds,
                        lambda: f"{self.name}: cells still running or not run (prompts {self.prompts()}, "
                                f"kernel {self.kernel_status()}{self.dialog_note()})", poll=0.5)

    def save(self, seconds: float = 30) -> None:
        """Ctrl+S on a notebook its run has modified, then wait until its tab is no longer
        marked as modified."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys

        def modified():
            return self.driver.find_elements(By.CSS_SELECTOR, f"{CURRENT_TAB}.jp-mod-dirty")

        wait_for(modified, 10, f"{self.name}: not marked as modified after its run")
        ActionChains(self.driver).key_down(Keys.CONTROL).send_keys("s").key_up(Keys.CONTROL).perform()
        wait_for(lambda: not modified() and self.driver.find_elements(By.CSS_SELECTOR, CURRENT_TAB),
                 seconds, f"{self.name}: still unsaved after Ctrl+S")

    def show_first_output(self) -> None:
        """Scroll the first figure into view, or else the first output (the end of a run
        shows mostly the last cell's source)."""
        from selenium.webdriver.common.by import By

        for selector in (".jp-OutputArea-output img", ".jp-OutputArea-output"):
            found = self.driver.find_elements(By.CSS_SELECTOR, selector)
            if found:
                self.driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", found[0])
                time.sleep(0.5)  # let the windowed notebook render the cells now in view
                return

    def screenshot(self, path: Path) -> Path:
        """PNG of the browser's window at `path` (an earlier file of that name is replaced)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self.driver.save_screenshot(str(path)):
            raise BrowserTestError(f"no screenshot written to {path}")
        return path
