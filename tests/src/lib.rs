//! Cross-crate integration tests live in `tests/tests/`; their fixtures in
//! `tests/fixtures/`. This library is empty: the crate exists to hold them.
