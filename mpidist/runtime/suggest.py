""" "Did you mean": the known names nearest a mistyped one, for the messages that refuse it."""

import difflib


def nearest(word, known, count=1, cutoff=0.6):
    """Up to ``count`` names of ``known`` close to ``word`` (difflib's ratio of ``cutoff`` or more), closest
    first; a name that differs only in case comes first of all.

    >>> nearest("pipline", ["local", "pipeline", "ps-sync"])
    ['pipeline']
    >>> nearest("Proline", ["alcohol", "proline"])
    ['proline']
    """
    known = [str(name) for name in known]
    same = [name for name in known if name.lower() == str(word).lower() and name != word]
    close = difflib.get_close_matches(str(word), known, n=count + len(same), cutoff=cutoff)
    return (same + [name for name in close if name not in same])[:count]


def did_you_mean(word, known, shown=None):
    """``" (did you mean X?)"``, or ``""`` where nothing is close; ``shown`` turns the name found into what
    the message shows (a flag with its ``--``, a spec with its arguments)."""
    found = nearest(word, known)
    if not found:
        return ""
    return f" (did you mean {shown(found[0]) if shown else found[0]}?)"
