"""posinterp's figures never touch the user's matplotlib backend or pyplot state (issue 27:
importing posinterp.viz used to call ``matplotlib.use("Agg")``, after which a notebook
user's own ``plt.show()`` drew nothing)."""

import subprocess
import sys
import textwrap


def test_figures_leave_the_backend_and_pyplot_alone(tmp_path):
    script = textwrap.dedent(f"""
        import matplotlib
        matplotlib.use("svg")           # the user's choice, as %matplotlib inline would be
        import matplotlib.pyplot as plt
        import pandas as pd, torch
        import posinterp.viz
        from posinterp.viz import Report
        from posinterp.viz.figures import adjacency_plot, save_figure, similarity_grid
        df = pd.DataFrame({{"hook": ["a", "b"], "metric": "adjacency_score",
                           "value": [0.5, 0.9], "state": "init"}})
        fig = adjacency_plot(df)
        grid = similarity_grid({{"x": torch.eye(4)}})
        paths = save_figure(grid, r"{tmp_path / 'grid'}")
        Report("t").figure(fig)
        user = plt.figure()                 # the user's own pyplot figure is untouched
        print(matplotlib.get_backend(), plt.get_fignums() == [user.number],
              all(p.stat().st_size > 0 for p in paths))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["svg", "True", "True"], out.stderr


def test_figures_display_as_images_in_ipython():
    """A cell whose value is a posinterp figure shows an image: IPython's own display
    formatter (the one a kernel runs on a cell's result) gives it an ``image/png`` that
    decodes to the drawing (issue 39: a figure made without pyplot had no formatter and
    showed as ``<Figure size 640x330 with 3 Axes>``)."""
    import io

    import matplotlib.image
    import pandas as pd
    import pytest
    import torch

    pytest.importorskip("IPython")
    from IPython.core.formatters import DisplayFormatter

    from posinterp.viz.figures import adjacency_plot, similarity_grid

    df = pd.DataFrame({"hook": ["a", "b"], "metric": "adjacency_score", "value": [0.5, 0.9],
                       "state": "init"})
    for fig in (similarity_grid({"x": torch.eye(4), "y": torch.ones(4, 4)}), adjacency_plot(df)):
        data, _ = DisplayFormatter().format(fig)
        assert data["text/plain"].startswith("<"), data["text/plain"]
        assert "image/png" in data, sorted(data)
        img = matplotlib.image.imread(io.BytesIO(data["image/png"]), format="png")
        width, height = fig.get_size_inches() * fig.dpi
        # the figure at its own dpi, cropped (or grown) to what is drawn, as the inline
        # backend shows it
        assert 0.5 < img.shape[1] / width < 1.5 and 0.5 < img.shape[0] / height < 1.5
        assert len({tuple(px) for px in img.reshape(-1, img.shape[-1])[::7]}) > 2  # not blank
