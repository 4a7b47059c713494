-- Connected integration accounts. Tokens are AES-256-GCM ciphertext (nonce || ciphertext),
-- bound to (user_id, integration, account) as associated data.
CREATE TABLE gateway.accounts (
    user_id       text        NOT NULL,
    integration   text        NOT NULL,
    account       text        NOT NULL,
    access_token  bytea       NOT NULL,
    refresh_token bytea,
    expires_at    timestamptz,
    scopes        text[]      NOT NULL DEFAULT '{}',
    status        text        NOT NULL DEFAULT 'connected',
    connected_at  timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, integration, account)
);

-- Results of side-effect calls by idempotency key (P-4).
CREATE TABLE gateway.idempotency (
    user_id     text        NOT NULL,
    key         text        NOT NULL,
    tool        text        NOT NULL,
    args_sha256 text        NOT NULL,
    outcome     jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, key)
);

-- Every tool call and upstream call (G-9). Never arguments, tokens or bodies.
CREATE TABLE gateway.audit (
    id             bigserial   PRIMARY KEY,
    at             timestamptz NOT NULL DEFAULT now(),
    user_id        text        NOT NULL,
    kind           text        NOT NULL,
    tool           text        NOT NULL,
    integration    text,
    account        text,
    call_id        text        NOT NULL,
    run_id         text,
    status         text        NOT NULL,
    latency_ms     integer     NOT NULL,
    bytes          integer     NOT NULL,
    upstream_calls integer     NOT NULL
);
CREATE INDEX audit_user_at ON gateway.audit (user_id, id);

-- Fixed rate-limit windows shared by replicas (G-6).
CREATE TABLE gateway.rate_windows (
    limit_key    text    NOT NULL,
    window_secs  integer NOT NULL,
    window_start bigint  NOT NULL,
    used         integer NOT NULL,
    PRIMARY KEY (limit_key, window_secs)
);
