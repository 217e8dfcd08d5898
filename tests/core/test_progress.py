"""Progress bars: drawn as tqdm draws them, except inside terminal_only() where stderr is no terminal (a log, a
pipe): there neither ours nor the libraries' bars reach it, and everything else a library writes still does."""
from __future__ import annotations

import sys

from tqdm import tqdm

from powerinfer_tools.core.progress import library_bars, progress_bar, terminal_only


def draw(bar) -> None:
    for _ in bar:
        pass


def test_bars_show_by_default(capsys):
    draw(progress_bar(range(3), desc="ours"))
    assert "ours: 100%|" in capsys.readouterr().err


def test_terminal_only_hides_our_bars_and_a_librarys_but_not_its_messages(capsys):
    with terminal_only():
        draw(progress_bar(range(3), desc="ours"))
        with library_bars():
            draw(tqdm(range(3), desc="theirs"))  # a library's own tqdm, past every switch
            print("a library's warning", file=sys.stderr)
    err = capsys.readouterr().err
    assert err == "a library's warning\n", err
    draw(progress_bar(range(3), desc="after"))  # the block's end puts the bars back
    assert "after: 100%|" in capsys.readouterr().err
