//! One throwaway PostgreSQL database per test: shared with the services' own binary tests.

pub use svc_kit::testing::TestDb;
