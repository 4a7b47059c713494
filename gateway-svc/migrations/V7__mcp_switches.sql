-- MCP servers and tools a user turned off for themselves (issue 15). A row with tool = '' turns
-- off the whole server. Absent rows mean on: new servers and tools are on by default.
CREATE TABLE gateway.mcp_disabled (
    user_id    text        NOT NULL,
    server     text        NOT NULL,
    tool       text        NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, server, tool)
);
