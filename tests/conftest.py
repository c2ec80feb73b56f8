"""Fixtures shared by the test modules.

``reliability`` (tests/_reliability.py) is offered here rather than imported into each suite: a
fixture imported into a test module and then requested as a test's argument reads to pyflakes as
a name redefined while unused (ruff F811).
"""

from tests._reliability import reliability  # noqa: F401  (a fixture: pytest finds it in conftest.py)
