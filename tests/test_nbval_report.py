"""A failed notebook cell's report shows what the cell printed (conftest.py's report hook)."""

import nbformat

from conftest import cell_output_text


def test_a_failed_cells_report_shows_its_streams_and_the_markdown_or_plain_text_of_its_displays():
    outputs = [nbformat.v4.new_output("stream", name="stdout", text="peak 341 GFLOP/s\n"),
               nbformat.v4.new_output("display_data", data={"text/markdown": "**What we saw.** 4.0 FLOP/byte",
                                                            "text/plain": "<Markdown object>"}),
               nbformat.v4.new_output("execute_result", data={"text/plain": "0.49"}, execution_count=1),
               nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo="}),
               nbformat.v4.new_output("error", ename="AssertionError", evalue="late", traceback=[])]
    assert cell_output_text(outputs) == "peak 341 GFLOP/s\n\n**What we saw.** 4.0 FLOP/byte\n0.49"
    assert cell_output_text([]) == ""
