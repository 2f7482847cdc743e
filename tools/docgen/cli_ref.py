"""The CLI reference: every command and option of the argparse parser that `enlace` builds."""

from __future__ import annotations

import argparse
import importlib
import types

from .markdown import cell, code, slug

USAGE_WIDTH = 100


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias
                    continue
                seen.add(id(sub))
                out.append((name, helps.get(name, ""), sub))
    return out


def _usage_part(action: argparse.Action) -> str:
    value = _value(action)
    if not action.option_strings:  # positional
        name = value or action.dest
        if isinstance(action, argparse._SubParsersAction):
            name = f"{action.metavar or action.dest} ..."
        elif action.nargs == "?":
            name = f"[{name}]"
        elif action.nargs in ("*", "+"):
            name = f"{name} [{name} ...]" if action.nargs == "+" else f"[{name} ...]"
        return name
    if value and action.nargs == "?":
        value = f"[{value}]"
    elif value and action.nargs in ("*", "+"):
        value = f"{value} [{value} ...]" if action.nargs == "+" else f"[{value} ...]"
    text = f"{action.option_strings[0]} {value}".strip()
    return text if action.required else f"[{text}]"


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line, written here rather than by argparse: argparse's wrapping and layout change between
    Python versions and terminals, and the page must not."""
    parts = ["[-h]"] if any(isinstance(a, argparse._HelpAction) for a in parser._actions) else []
    optional = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    positional = [a for a in parser._actions if not a.option_strings]
    parts += [_usage_part(a) for a in optional + positional if a.help != argparse.SUPPRESS]
    lead = f"usage: {parser.prog} "
    lines = [""]
    for part in parts:  # wrapped between parts, never inside one
        if lines[-1] and len(lead) + len(lines[-1]) + 1 + len(part) > USAGE_WIDTH:
            lines.append("")
        lines[-1] = f"{lines[-1]} {part}".strip()
    return "\n".join((lead if i == 0 else " " * len(lead)) + line for i, line in enumerate(lines)).rstrip()


def _names(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(action.option_strings)
    return action.metavar if isinstance(action.metavar, str) else action.dest


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if isinstance(action.metavar, tuple):
        return " ".join(action.metavar)
    if action.metavar is not None:
        return action.metavar
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper() if action.option_strings else ""


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0 or d == []:
        return ""
    return code(d if isinstance(d, str) else repr(d))


def _shared_options(cli: types.ModuleType) -> list[argparse.Action]:
    """The options every config-reading command shares (cli.common_parser), documented once."""
    make = getattr(cli, "common_parser", None)
    if make is None:
        return []
    return [a for a in make()._actions if not isinstance(a, argparse._HelpAction)]


def _action_key(a: argparse.Action) -> tuple:
    return (tuple(a.option_strings), a.dest, str(a.default), a.help)


def _options_table(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    rows = ["| argument | value | default | what it does |", "|---|---|---|---|"]
    formatter = parser._get_formatter()
    expand = getattr(formatter, "_expand_help", lambda action: action.help)  # fills in %(default)s
    for a in actions:
        text = expand(a) if a.help else ""
        rows.append(f"| {code(_names(a))} | {code(_value(a))} | {_default(a)} | {cell(text)} |")
    return rows


def _commands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser, bool]]:
    """(path, help, parser, has subcommands) of every command, depth first in `enlace --help` order."""
    out = []

    def collect(p: argparse.ArgumentParser, path: str, text: str) -> None:
        subs = _subparsers(p)
        if path:
            out.append((path, text, p, bool(subs)))
        for name, sub_text, sub in subs:
            collect(sub, f"{path} {name}".strip(), sub_text)

    collect(parser, "", "")
    return out


def _command_section(
    path: str, text: str, p: argparse.ArgumentParser, has_subs: bool, shared_keys: set
) -> list:
    out = [f"## enlace {path}", ""]
    if text:
        out += [cell(text), ""]
    out += ["```text", _usage(p), "```", ""]
    # Only a command that takes every shared option points to them; one that takes some lists its own.
    takes_shared = bool(shared_keys) and shared_keys <= {_action_key(a) for a in p._actions}
    actions = [
        a
        for a in p._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        and not (takes_shared and _action_key(a) in shared_keys)
    ]
    if actions:
        out += _options_table(p, actions) + [""]
    if takes_shared:
        out += ["Also takes the [config options](#config-options).", ""]
    if not actions and not takes_shared and not has_subs:
        out += ["No options.", ""]
    return out


def cli_reference(module: str = "enlace.cli") -> str:
    cli = importlib.import_module(module)
    parser: argparse.ArgumentParser = cli.build_parser()
    shared = _shared_options(cli)
    commands = _commands(parser)
    out = [
        "# CLI reference",
        "",
        "<!-- Generated by tools/gen_docs.py from the `enlace` command's argparse parser: do not edit. -->",
        "",
        "Every `enlace` command and its options, as `enlace COMMAND --help` prints them. User errors exit with",
        "status 2 and one line naming what and where.",
        "",
        "```text",
        _usage(parser),
        "```",
        "",
    ]
    if parser.description:
        out += [cell(parser.description), ""]
    out += ["| command | what it does |", "|---|---|"]
    for path, text, _, _ in commands:
        out.append(f"| [{code('enlace ' + path)}](#{slug('enlace ' + path)}) | {cell(text)} |")
    out.append("")
    if shared:
        out += [
            "## Config options",
            "",
            "Commands that read the full config take these options: which params file, which file per",
            "layer, and overrides. See [Configuration](../configuration.md).",
            "",
        ]
        out += _options_table(parser, shared) + [""]
    shared_keys = {_action_key(a) for a in shared}
    for path, text, p, has_subs in commands:
        out += _command_section(path, text, p, has_subs, shared_keys)
    return "\n".join(out).rstrip() + "\n"
