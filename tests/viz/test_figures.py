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
