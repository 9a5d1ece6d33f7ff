"""The front door (minipar/cli.py): the lab's commands are found through entry points, so the reference
imports nothing of the lab; without the lab each of them is one line and exit 2."""

import pytest

from minipar import cli


@pytest.mark.parametrize("command", cli.LAB_COMMANDS)
def test_the_labs_commands_are_found_through_their_entry_points(command):
    main = cli.lab_command(command)
    assert callable(main) and main.__module__.startswith("minipar_lab.")


@pytest.mark.parametrize("command", cli.LAB_COMMANDS)
def test_without_the_lab_its_commands_are_one_line_and_exit_2(command, monkeypatch, capsys):
    monkeypatch.setattr(cli, "entry_points", lambda group: [])  # as if minipar_lab were not installed
    assert cli.main([command, "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "minipar_lab" in err and "not installed" in err
