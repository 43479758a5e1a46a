"""A stored node's edge list kept apart from its row, so that an edge added to a stored node does
not rewrite the node's whole row (a 5 kB result, a coding session's 50 kB file read, for one
36-byte id): the store's format (docs/design-decisions.md, "A node's edge list apart from its row").

jaclang's table `anchors` becomes the table `anchor_rows` (the same columns, the same rows), beside
`edge_lists` (node id, its whole edge list as a JSON text, its version), and `anchors` is a view
over both: a node with an `edge_lists` row reads with that edge list and version in place of its
row's (`json_set`, which keeps every other value's text as stored; the text is written without
spaces, which every reader parses alike). So every reader of the file, whatever it runs, reads the
same graph: jaclang's own `SqliteMemory` (`jac db fsck`, `jac dot`, which open the file without
ContextRender's store), the store's own SQL (`edge_targets`), earlier versions of ContextRender,
scale-out processes. Writes through the view keep the rule in one place, its triggers: a row
written whole (jaclang's merge, a merge on the row's text, a quarantine's edge strip) takes its
edge list back into the row and its `edge_lists` row goes (only when the row was written: an
`INSERT OR IGNORE` that a stored row turned away keeps it, as `changes()` inside the trigger
tells); a deleted node's goes with it.

A merge by id (adapters/by_id.py: edges added to a stored node the call never loaded) writes the
node's `edge_lists` row (`write_edge_list`), the node's row left as it is; every other merge writes
the row whole, its edge list in it. Both tables are written in the flush's one transaction: a
process killed mid-write leaves the last committed state.

A store is given this form when the store first opens it (`give_form`: one transaction, its rows
not rewritten: a table renamed, a table, a view and its triggers created); `has_form` tells, read
only. The flag `schema_meta.edge_lists` records it.
"""

from __future__ import annotations

import sqlite3

__all__ = ["EDGE_LISTS_VERSION", "ROWS", "STORED_NODE", "give_form", "has_form", "write_edge_list"]

# The form's version, in `schema_meta` under the key `edge_lists`.
EDGE_LISTS_VERSION = "1"
# The table the rows are in (`anchors` is the view over it).
ROWS = "anchor_rows"

# The statements that give a store this form, in order.
_FORM = (
    """ALTER TABLE anchors RENAME TO anchor_rows""",
    """CREATE TABLE IF NOT EXISTS edge_lists (node TEXT PRIMARY KEY, edges TEXT NOT NULL, version INTEGER NOT NULL) WITHOUT ROWID""",
    """CREATE VIEW anchors (id, type, arch_module, arch_type, fingerprint, data, format_version, updated_at) AS
  SELECT r.id, r.type, r.arch_module, r.arch_type, r.fingerprint,
         CASE WHEN e.node IS NULL THEN r.data ELSE json_set(r.data, '$.edges', json(e.edges), '$.version', e.version) END,
         r.format_version, r.updated_at
  FROM anchor_rows AS r LEFT JOIN edge_lists AS e ON e.node = r.id""",
    """CREATE TRIGGER anchors_insert INSTEAD OF INSERT ON anchors BEGIN
  INSERT INTO anchor_rows (id, type, arch_module, arch_type, fingerprint, data, format_version, updated_at)
    VALUES (NEW.id, NEW.type, NEW.arch_module, NEW.arch_type, NEW.fingerprint, NEW.data, NEW.format_version, NEW.updated_at);
  DELETE FROM edge_lists WHERE node = NEW.id AND changes() > 0;
END""",
    """CREATE TRIGGER anchors_update INSTEAD OF UPDATE ON anchors BEGIN
  UPDATE anchor_rows SET id = NEW.id, type = NEW.type, arch_module = NEW.arch_module, arch_type = NEW.arch_type,
    fingerprint = NEW.fingerprint, data = NEW.data, format_version = NEW.format_version, updated_at = NEW.updated_at
    WHERE id = OLD.id;
  DELETE FROM edge_lists WHERE node = OLD.id;
END""",
    """CREATE TRIGGER anchors_delete INSTEAD OF DELETE ON anchors BEGIN
  DELETE FROM anchor_rows WHERE id = OLD.id;
  DELETE FROM edge_lists WHERE node = OLD.id;
END""",
)

# A stored node as a merge by id reads it: its row as stored (the text a merge remembers and
# re-uses: adapters/merges.py) and its `edge_lists` row's edge list and version, None when none.
STORED_NODE = ("SELECT r.type, r.arch_module, r.arch_type, r.fingerprint, r.data, r.format_version, e.edges, e.version"
               " FROM anchor_rows AS r LEFT JOIN edge_lists AS e ON e.node = r.id WHERE r.id = ?")


def has_form(conn: sqlite3.Connection) -> bool:
    """Whether the store has this form (read only)."""
    found = conn.execute("SELECT type FROM sqlite_master WHERE name IN ('anchors', 'anchor_rows', 'edge_lists')").fetchall()
    return sorted(kind for (kind,) in found) == ["table", "table", "view"]


def give_form(conn: sqlite3.Connection) -> None:
    """Give a store in jaclang's form (its table `anchors`, as jaclang creates it) this form, in one
    write transaction (a store another process gave it meanwhile is left as it is)."""
    conn.commit()
    conn.execute("BEGIN IMMEDIATE")
    try:
        if not has_form(conn):
            for statement in _FORM:
                conn.execute(statement)
            conn.execute("INSERT OR REPLACE INTO schema_meta (key, value) VALUES ('edge_lists', ?)", (EDGE_LISTS_VERSION,))
        conn.commit()
    except BaseException:
        conn.rollback()
        raise


def write_edge_list(conn: sqlite3.Connection, key: str, edges_text: str, version: int) -> None:
    """Store node `key`'s edge list (`edges_text`, its JSON text) and version apart from its row."""
    conn.execute("INSERT OR REPLACE INTO edge_lists (node, edges, version) VALUES (?, ?, ?)", (key, edges_text, version))
