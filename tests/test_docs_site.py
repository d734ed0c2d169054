"""The documentation: every relative link resolves, and the built site renders in headless Chromium.

The link check reads the Markdown sources (docs/*.md and README.md, which GitHub renders and mkdocs does not
build) and needs nothing installed. The site tests build it with ``mkdocs build --strict`` (whose ``validation:``
settings in mkdocs.yml fail the build on a broken link or anchor too), serve it from a local ``http.server`` and
open pages in headless Chromium, as a reader's browser would; they skip without mkdocs or Chromium. The pages
that render docstrings are read for markup mkdocstrings does not render (Sphinx roles, pydantic's ``Field(...)``
calls), and the main pages are laid out at 1280 px: nothing wider than the window, no inline code in a table cell
broken in the middle of a word.
"""

from __future__ import annotations

import functools
import html
import http.server
import inspect
import io
import json
import os
import pydoc
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch
from headless import chromium, distinct_colours, launch, png_rgb
from pydantic import BaseModel

import kitsune

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]

FENCE = re.compile(r"^ *(```|~~~).*?^ *\1", re.M | re.S)
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
AUTODOC = re.compile(r"^:::\s*([\w.]+)", re.M)


def prose(text: str) -> str:
    """The Markdown without code: fenced blocks and inline code spans can hold anything that looks like a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slugify(heading: str) -> str:
    """Python-Markdown's toc slug, as mkdocs makes anchors: the heading's text, lowercase, punctuation dropped,
    runs of spaces and hyphens to one '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[`*]|<[^>]+>", "", text)  # code and emphasis marks, inline HTML
    text = re.sub(r"[^\w\s-]", "", html.unescape(text)).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors a page has: one per heading (a repeated heading gets _1, _2, ...), and mkdocstrings' ids."""
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for _, heading in HEADING.findall(text):
        slug = slugify(heading)
        out.add(f"{slug}_{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    out.update(AUTODOC.findall(text))  # `::: kitsune.optim.Lion` renders an object whose id is its path
    return frozenset(out)


def has_anchor(path: Path, anchor: str) -> bool:
    if anchor in anchors(path):
        return True
    # a member of a documented object (api.md#kitsune.optim.Lion.step): mkdocstrings gives it its dotted path
    documented = [name for name in anchors(path) if anchor.startswith(name + ".")]
    return bool(documented) and pydoc.locate(anchor) is not None


def relative_links(path: Path) -> list[str]:
    links = []
    for target in LINK.findall(prose(path.read_text())):
        scheme = urlsplit(target).scheme
        if not scheme and not target.startswith("//"):
            links.append(target)
    return links


def test_the_link_checker_finds_links_and_anchors():
    sample = DOCS / "migration.md"
    assert "fusion.md#what-gets-fused" in relative_links(sample)
    assert slugify("`kitsune.clip_grad_norm_`") == "kitsuneclip_grad_norm_"
    assert slugify("From torch's `fused=True` or `foreach=True`") == "from-torchs-fusedtrue-or-foreachtrue"
    assert slugify("AdamW step, H100, 2026-11-22") == "adamw-step-h100-2026-11-22"
    assert "your-own-gradscaler" in anchors(DOCS / "amp.md")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(source: Path):
    broken = []
    for link in relative_links(source):
        parts = urlsplit(link)
        target = (source.parent / unquote(parts.path)).resolve() if parts.path else source
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif parts.fragment and target.suffix == ".md" and not has_anchor(target, unquote(parts.fragment)):
            broken.append(f"{link}: {target.name} has no heading or object with the anchor #{parts.fragment}")
    assert not broken, f"{source.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


# -- the built site -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # from another folder: a path in mkdocs.yml (the snippets' base_path) must be relative to the config, not the cwd
    elsewhere = tmp_path_factory.mktemp("cwd")
    proc = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no request lines in the test output
        pass


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    """The built site on a free localhost port, served from a background thread until the module's tests end."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)
    assert not thread.is_alive()


def render(url: str, tmp: Path) -> tuple[str, Path]:
    """The page's DOM after its scripts ran, and a 1280x1600 screenshot of it."""
    chromium()
    png = tmp / "shot.png"
    shot = launch(url, tmp / "chromium-shot", f"--screenshot={png}", "--window-size=1280,1600", "--hide-scrollbars")
    dom = launch(url, tmp / "chromium-dom", "--dump-dom")
    dom_html, _ = dom.communicate(timeout=90)
    shot.communicate(timeout=90)
    assert dom.returncode == 0 and shot.returncode == 0 and png.is_file()
    return dom_html, png


def text_of(dom_html: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", dom_html)).split())


def check_not_blank(png: Path) -> None:
    rgb = png_rgb(png)
    assert rgb.shape == (1600, 1280, 3)
    non_white = (rgb < 235).any(axis=-1).mean()
    assert non_white > 0.02, f"screenshot is almost blank ({non_white:.3%} non-white pixels)"
    assert distinct_colours(rgb) > 50, f"only {distinct_colours(rgb)} distinct colours"
    header = rgb[:40].reshape(-1, 3).astype(int)  # the theme's deep-orange header bar
    assert ((header[:, 0] > 200) & (header[:, 2] < 120)).mean() > 0.5, "the header is not drawn in the theme colour"


def test_home_page_renders(server: str, tmp_path: Path):
    dom_html, png = render(server, tmp_path)
    assert re.search(r"<title>kitsune</title>", dom_html)
    text = text_of(dom_html)
    assert "makes the optimizer phase of PyTorch training fast" in text
    assert "Migrating to kitsune" in text  # the nav
    check_not_blank(png)


def test_api_reference_page_renders_the_docstrings(server: str, tmp_path: Path):
    dom_html, png = render(server + "api/", tmp_path)
    assert "<title>API reference - kitsune</title>" in dom_html
    assert 'id="kitsune.KitsuneOptimizer"' in dom_html
    text = text_of(dom_html)
    summary = inspect.getdoc(kitsune.KitsuneOptimizer).splitlines()[0].replace("``", "")
    assert summary in text, summary  # the class docstring's first line, rendered
    params = inspect.signature(kitsune.KitsuneOptimizer).parameters
    assert all(name in text for name in params), "the Args table lists every constructor argument"
    check_not_blank(png)


ROLE = re.compile(r":(?:py:)?(?:class|meth|func|data|mod|attr|obj|exc|const):`?")
DOCSTRING_PAGES = sorted(path.stem for path in DOCS.glob("*.md") if AUTODOC.search(path.read_text()))


@pytest.mark.parametrize("page", DOCSTRING_PAGES)
def test_docstrings_render_without_sphinx_roles(site: Path, page: str):
    """mkdocstrings renders Markdown: a docstring's cross-reference is [`X`][kitsune.X] or `X`, never :class:`X`."""
    text = text_of((site / page / "index.html").read_text())
    found = sorted({match.group(0) for match in re.finditer(r".{0,40}" + ROLE.pattern + r"\S*", text)})
    assert not found, f"docs/{page}.md renders Sphinx roles as text:\n" + "\n".join(found)


@pytest.mark.parametrize("page", DOCSTRING_PAGES)
def test_config_models_render_defaults_not_field_calls(site: Path, page: str):
    """griffe-pydantic (mkdocs.yml) shows each field with its default; configuration.md hides the private base."""
    text = text_of((site / page / "index.html").read_text())
    assert "Field(" not in text, f"docs/{page}.md shows pydantic Field(...) calls"
    assert not re.search(r"Bases: _\w", text), f"docs/{page}.md shows a private base class"
    if page == "configuration":
        models = [pydoc.locate(path) for path in AUTODOC.findall((DOCS / f"{page}.md").read_text())]
        assert len(models) == 9 and all(models)
        for model in models:
            for name, field in model.model_fields.items():
                # griffe-pydantic reads the source: it shows no default for a default_factory, nor for a default
                # that is a call (KitsuneConfig's sections, `amp: AMPConfig = AMPConfig(enabled=False)`)
                if field.default_factory is None and not isinstance(field.default, BaseModel):
                    assert f"{name} = " in text, f"{model.__name__}.{name} is shown without its default"


# -- layout at 1280 px ----------------------------------------------------------------------------------------------
WIDTH = 1280
# Loads the page (?page=/api/) in a same-origin iframe 1280 px wide and writes what it measured into <pre id="out">,
# which --dump-dom returns (an iframe in the page holds back the load event that the dump waits for). Inline code in
# a table cell is broken mid-word when two of its characters on either side of a line break are not spaces.
LAYOUT_CHECK = """<!doctype html>
<html><head><meta charset="utf-8"></head><body style="margin:0"><pre id="out">pending</pre><script>
function brokenCode(doc) {
  const out = [];
  for (const code of doc.querySelectorAll("td code, th code")) {
    if (code.closest("pre") || code.getClientRects().length < 2) continue;
    const walker = doc.createTreeWalker(code, NodeFilter.SHOW_TEXT), range = doc.createRange();
    let prev = null, broken = false;
    for (let node = walker.nextNode(); node && !broken; node = walker.nextNode()) {
      for (let i = 0; i < node.length && !broken; i++) {
        range.setStart(node, i);
        range.setEnd(node, i + 1);
        const rect = range.getClientRects()[0], ch = node.data[i];
        if (!rect) continue;
        broken = prev !== null && rect.top > prev.top + prev.height / 2 && !/\\s/.test(ch) && !/\\s/.test(prev.ch);
        prev = {top: rect.top, height: rect.height, ch};
      }
    }
    if (broken) out.push(code.textContent);
  }
  return out;
}
const frame = document.createElement("iframe");
frame.style.cssText = "width:WIDTHpx;height:1600px;border:0;display:block";
frame.onload = () => {
  const doc = frame.contentDocument;
  document.getElementById("out").textContent = JSON.stringify({
    title: doc.title, scrollWidth: doc.documentElement.scrollWidth, brokenCode: brokenCode(doc),
  });
};
frame.src = new URLSearchParams(location.search).get("page");
document.body.appendChild(frame);
</script></body></html>
""".replace("WIDTH", str(WIDTH))


def layout(server: str, site: Path, page: str, tmp: Path) -> dict:
    """What the layout check measured on ``page`` (a path under the site: "" for the home page, "api/")."""
    chromium()
    (site / "_layout-check.html").write_text(LAYOUT_CHECK)
    args = ("--dump-dom", f"--window-size={WIDTH},1600", "--hide-scrollbars")
    proc = launch(f"{server}_layout-check.html?page=/{page}", tmp / "chromium-layout", *args)
    dom_html, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0
    out = re.search(r'<pre id="out">(.*?)</pre>', dom_html, re.S)
    assert out and out[1] != "pending", f"the layout check did not run:\n{dom_html[:2000]}"
    return json.loads(html.unescape(out[1]))


def test_the_layout_check_sees_a_wide_page_and_code_broken_mid_word(server: str, site: Path, tmp_path: Path):
    sample = (
        '<!doctype html><html><body><div style="width:2000px">wide</div><table><tr><td style="width:40px">'
        '<code style="word-break:break-all">a_long_identifier_that_cannot_fit</code></td>'
        "<td><code>short</code></td></tr></table></body></html>"
    )
    (site / "_layout-sample.html").write_text(sample)
    measured = layout(server, site, "_layout-sample.html", tmp_path)
    assert measured["scrollWidth"] > WIDTH
    assert measured["brokenCode"] == ["a_long_identifier_that_cannot_fit"]


@pytest.mark.parametrize(
    "page", ["", "quickstart/", "configuration/", "api/"], ids=["home", "quickstart", "configuration", "api"]
)
def test_page_fits_1280_px(server: str, site: Path, page: str, tmp_path: Path):
    """Nothing is wider than a 1280 px window, and no table cell breaks inline code mid-word (a screenshot of the
    page stays in the test's tmp dir, shot.png)."""
    png = tmp_path / "shot.png"
    args = (f"--screenshot={png}", f"--window-size={WIDTH},1600", "--hide-scrollbars")
    shot = launch(server + page, tmp_path / "chromium-shot", *args)
    measured = layout(server, site, page, tmp_path)
    shot.communicate(timeout=90)
    assert shot.returncode == 0 and png.is_file()
    check_not_blank(png)
    assert measured["scrollWidth"] <= WIDTH, f"/{page} is {measured['scrollWidth']} px wide at {WIDTH} px"
    assert not measured["brokenCode"], f"/{page}: table cells break inline code mid-word: {measured['brokenCode']}"


# -- what the pages say ---------------------------------------------------------------------------------------------
def test_memory_page_one_pooled_state_tensor_saves_its_arena(monkeypatch: pytest.MonkeyPatch):
    """docs/memory.md#saving-one-state-tensor: torch.save of one pooled state tensor writes its whole arena; its
    clone, the state dict saved whole and a state tensor with the pool off are the size of the tensors."""
    cuda = torch.cuda.is_available()
    if not cuda:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fused kernel, and so the pool, on CPU params
    device = "cuda" if cuda else "cpu"

    def saved_bytes(obj: object) -> int:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.tell()

    def trained(**kwargs: object) -> tuple[kitsune.KitsuneOptimizer, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(device)
        optimizer = kitsune.KitsuneOptimizer(torch.optim.AdamW(model.parameters()), enable_fusion=True, **kwargs)
        model(torch.randn(8, 64, device=device)).sum().backward()
        optimizer.step()
        return optimizer, optimizer.state[model[0].weight]["exp_avg"]

    optimizer, exp_avg = trained()
    arena = exp_avg.untyped_storage().nbytes()
    own = exp_avg.nbytes  # 64 * 64 * 4 = 16 KB
    assert arena > 2 * own, "the state tensor is not a view of an arena: is the pool on?"
    assert saved_bytes(exp_avg) > arena  # 68 KB
    assert saved_bytes(exp_avg.clone()) < own + 4096  # 18 KB
    assert saved_bytes(optimizer.state_dict()) < arena + 8192  # each arena once
    _, unpooled = trained(memory_pool_size=0)
    assert unpooled.untyped_storage().nbytes() == own and saved_bytes(unpooled) < own + 4096


def test_read_the_docs_installs_the_docs_extra():
    """docs/requirements.txt (what .readthedocs.yaml installs) lists exactly pyproject.toml's ``docs`` extra."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^docs = \[(.*)\]\s*$", pyproject, re.M)  # one line; greedy: an extra has [ ] too
    assert extra, "pyproject.toml has no docs extra"
    wanted = set(re.findall(r'"([^"]+)"', extra[1]))
    lines = (DOCS / "requirements.txt").read_text().splitlines()
    listed = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert wanted and listed == wanted
    assert "requirements: docs/requirements.txt" in (ROOT / ".readthedocs.yaml").read_text()


def test_installation_page_lists_every_extra_with_its_packages():
    """docs/installation.md's Extras table has a row per extra of pyproject.toml, naming each of its packages."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = {
        m[1]: re.findall(r'"([A-Za-z0-9_.-]+)', m[2]) for m in re.finditer(r"^(\w+) = \[(.*)\]\s*$", section, re.M)
    }
    assert {"dev", "docs", "bench"} <= extras.keys(), extras
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", (ROOT / "docs" / "installation.md").read_text(), re.M))
    assert rows.keys() == extras.keys()
    for extra, packages in extras.items():
        missing = [p for p in packages if p.lower() not in rows[extra].lower()]
        assert not missing, f"the {extra} row misses {missing}"


def test_configuration_page_snippets_run_as_written():
    """docs/configuration.md's ```python snippets run pasted into a fresh interpreter: each imports and defines what
    it uses."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    found = re.findall(r"^```python[^\n]*\n(.*?)^```", page, re.M | re.S)
    assert found, "no snippet found"
    for source in found:
        exec(compile(source, "docs/configuration.md", "exec"), {"__name__": "__main__"})
