"""`make trace-viewer`: a trace of `make demo`'s layout opened in a real viewer, offline, and photographed.

`--trace DIR`'s checker (minipar/trainer/trace_summary.py) is the project's own reading of the Chrome
trace event format; this is a second, independent one: speedscope's importer (its npm package ships the
built web app) in Debian's headless Chromium. The script trains 2 steps of the demo's layout on 8 ranks
(dp 2 x pp 2 x tp 2, ZeRO-1, 4 micro-batches) with --trace, serves the speedscope app and the trace from
a local http.server (speedscope loads `index.html#profileURL=...`), and fails unless
- the page's console says speedscope imported it as a Trace Event Format profile, and shows none of the
  warnings its importer gives for spans that do not nest ("Tried to end ...", "... still open at end
  of profile") nor a failed import;
- the page (Chromium's --dump-dom) lists one profile per track with spans (speedscope makes one per
  pid/tid), the first named by the trace's own process_name and thread_name;
then writes the screenshot lesson 07 shows (lessons/figures/07_trace_speedscope.png).

Needs `chromium` on PATH and speedscope under build/viewer/node_modules: `make trace-viewer` installs
both (never `make test`, never minipar itself). Nothing leaves the machine: the server listens on
127.0.0.1 and the page loads only what it serves.

    python tests/trace_viewer.py [--ranks 8]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minipar.trainer.launch import run_mpi  # noqa: E402
from minipar.trainer.trace_summary import format_problems  # noqa: E402

VIEWER = ROOT / "build" / "viewer"  # ignored (.gitignore's build/): speedscope and the trace
APP = "node_modules/speedscope/dist/release/index.html"
SCREENSHOT = ROOT / "lessons" / "figures" / "07_trace_speedscope.png"
DEMO_LAYOUT = ["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "1", "--microbatches", "4"]
WINDOW = "1400,420"  # speedscope draws rank 0's compute track at the top: steps > phases > actions
CHROMIUM = ["--headless=new", "--no-sandbox", "--disable-gpu", "--enable-unsafe-swiftshader",
            "--no-first-run", "--hide-scrollbars", f"--window-size={WINDOW}", "--virtual-time-budget=15000"]
PAGE_TIMEOUT_S = 60  # a page loads in about 3 s here
IMPORTED = "Importing as Trace Event Format profile"
# speedscope's own console lines when spans do not nest on a track, or when the import fails
# (dist/release/speedscope-*.js: console.warn / console.log / console.error in its importers)
TROUBLE = re.compile(r"Tried to end|still open at end of profile|Failed to load format|Error when "
                     r"loading|Unrecognized format|Empty profile|Unexpected .* format|Ignoring")
CONSOLE = re.compile(r":CONSOLE[:(]\d+\)?\] \"(.*)\", source: (\S+)")


def traced_demo(ranks: int, folder: Path) -> dict:
    """Train 2 steps of the demo's layout (on 2 ranks: pp 2 alone) with --trace; the checked trace."""
    layout = DEMO_LAYOUT if ranks == 8 else ["--pp", "2", "--microbatches", "4"]
    run_mpi(ranks, ["-m", "minipar", "train", *layout, "--steps", "2", "--batch-size", "8", "--quiet",
                    "--trace", str(folder)])
    trace = json.loads((folder / "trace.json").read_text())
    problems = format_problems(trace)
    if problems:
        raise SystemExit("trace_viewer: minipar's own checker refuses the trace: " + problems[0])
    return trace


def serve(folder: Path) -> http.server.ThreadingHTTPServer:
    """http.server on a free port of 127.0.0.1, serving `folder`, quiet, in a thread."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=folder))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def chromium(url: str, *extra: str) -> subprocess.CompletedProcess | None:
    """Headless Chromium on `url` with the page's console on stderr (--enable-logging=stderr --v=0);
    None if it hangs: an alert() (speedscope's answer to a file it cannot import) blocks a headless page."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise SystemExit("trace_viewer: no chromium on PATH (make trace-viewer installs Debian's chromium)")
    command = [binary, *CHROMIUM, "--enable-logging=stderr", "--v=0", *extra, url]
    # its own session, so that a hung browser goes with all its helper processes (its process group)
    browser = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = browser.communicate(timeout=PAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(browser.pid, signal.SIGKILL)
        browser.communicate()
        return None
    return subprocess.CompletedProcess(command, browser.returncode, stdout, stderr)


def console_lines(stderr: str, origin: str) -> list[str]:
    """The messages the page itself wrote to its console (not Chromium's own log lines)."""
    return [message for message, source in CONSOLE.findall(stderr) if source.startswith(origin)]


def expected_profiles(trace: dict) -> tuple[int, str]:
    """speedscope's profiles for this trace: one per (pid, tid) with spans, the first (lowest pid, tid)
    named "<process_name> (pid P), <thread_name> (tid T)" from the metadata events."""
    tracks = sorted({(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] in "XBE"})
    names = {(e["name"], e["pid"], e["tid"] if e["name"] == "thread_name" else None): e["args"]["name"]
             for e in trace["traceEvents"] if e["name"] in ("process_name", "thread_name")}
    pid, tid = tracks[0]
    first = (f"{names['process_name', pid, None]} (pid {pid}), {names['thread_name', pid, tid]} "
             f"(tid {tid})")
    return len(tracks), first


def check_page(trace: dict, url: str, origin: str) -> list[str]:
    """What is wrong with the page speedscope shows for the trace (empty: nothing), from its console
    and its DOM."""
    done = chromium(url, "--dump-dom")
    if done is None:
        return [f"Chromium did not finish in {PAGE_TIMEOUT_S} s: a dialog, such as speedscope's "
                "'Unrecognized format!' alert, holds the page"]
    console = console_lines(done.stderr, origin)
    problems = [f"console: {line}" for line in console if TROUBLE.search(line)]
    if IMPORTED not in console:
        problems.append(f"speedscope never said {IMPORTED!r}; its console: {console}")
    count, first = expected_profiles(trace)
    page = re.sub(r"<[^>]+>", " ", done.stdout).replace("&nbsp;", " ")
    if f"{first} (1/{count})" not in " ".join(page.split()):
        problems.append(f"the page does not show {first!r} as profile 1 of {count}: {page[:400]!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, choices=(2, 8), default=8)
    args = parser.parse_args(argv)
    if not (VIEWER / APP).is_file():
        raise SystemExit(f"trace_viewer: no {VIEWER / APP} (make trace-viewer installs speedscope)")
    trace = traced_demo(args.ranks, VIEWER / "trace")
    server = serve(VIEWER)
    origin = f"http://127.0.0.1:{server.server_address[1]}/"
    url = f"{origin}{APP}#profileURL={quote('/trace/trace.json', safe='')}"
    problems = check_page(trace, url, origin)
    for problem in problems:
        print(f"trace_viewer: {problem}", file=sys.stderr)
    if not problems:
        chromium(url, f"--screenshot={SCREENSHOT}")
        print(f"trace_viewer: speedscope imported the trace without a warning; {SCREENSHOT} written")
    server.shutdown()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
