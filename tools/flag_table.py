"""train.py's flags as markdown tables, one per group of its --help, from the declarations the parser is
built from (train.build_parser: common.ModelConfig's model flags, harness/optim.py's schedule and AdamW,
data.py's data flags, ...), so the docs never list a flag by hand:

    python -m tools.flag_table                              # print the tables
    python -m tools.flag_table --into docs/training.md      # write them between the file's markers

The markers: MARKERS below, each on a line of its own.
"""
import argparse
import sys

from harness.cli import ExitParser, DefaultsHelp, check_output_file, run_command

MARKERS = ("<!-- flag table: python -m tools.flag_table --into docs/training.md -->\n", "<!-- end of flag table -->")


def flag_tables():
    """The markdown text: per argument group of train.py's parser, | flag | meaning | rows, the meaning
    being the flag's --help text with its default (as --help shows it)."""
    import train
    parser = train.build_parser()
    helper = DefaultsHelp("train.py")
    out = []
    for group in parser._action_groups:  # argparse has no public list of a parser's groups
        rows = [a for a in group._group_actions if a.help is not argparse.SUPPRESS and a.dest != "help"]
        if not rows:
            continue
        out += [f"**{group.title}**", "", "| flag | meaning |", "|---|---|"]
        for a in rows:
            name = a.option_strings[0]
            if isinstance(a, argparse.BooleanOptionalAction):
                name = "--[no-]" + name[2:]
            text = helper._get_help_string(a) % {"default": a.default}
            out.append(f"| `{name}` | {text.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    p = ExitParser(prog="python -m tools.flag_table", description=__doc__.split("\n")[0])
    p.add_argument("--into", default=None, help="markdown file to write the tables into, between its markers "
                   "(default: print them)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    text = flag_tables()
    if a.into is None:
        print(text, end="")
        return 0
    from common import UsageError
    from tools.sweep_report import replace_between_markers
    try:
        check_output_file("--into", a.into)
        replace_between_markers(a.into, MARKERS, text)
    except UsageError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    run_command(main)
