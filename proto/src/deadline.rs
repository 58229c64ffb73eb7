//! gRPC deadlines on the wire.
//!
//! A client's deadline travels as the `grpc-timeout` request header: an
//! integer of at most eight digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`;
//! see gRPC's PROTOCOL-HTTP2). tonic applies it only to the call's first
//! response, not to a streaming body, so servers read it themselves and end
//! the stream with DEADLINE_EXCEEDED; the router forwards what is left of it
//! to the workers (`tonic::Request::set_timeout` writes the same header).

use std::time::Duration;

use tonic::metadata::MetadataMap;

/// The header carrying a call's timeout.
pub const GRPC_TIMEOUT_HEADER: &str = "grpc-timeout";

/// Parses a `grpc-timeout` value; `None` if it is malformed.
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The call's timeout from its metadata, if the client set a valid one.
pub fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    parse_grpc_timeout(metadata.get(GRPC_TIMEOUT_HEADER)?.to_str().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_malformed_values() {
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("5M"), Some(Duration::from_secs(300)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_grpc_timeout("9n"), Some(Duration::from_nanos(9)));
        for bad in ["", "m", "10", "10x", "-1S", "1.5S", "123456789S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn read_from_metadata_as_tonic_writes_it() {
        let mut req = tonic::Request::new(());
        req.set_timeout(Duration::from_millis(250));
        assert_eq!(
            grpc_timeout(req.metadata()),
            Some(Duration::from_millis(250))
        );
        assert_eq!(grpc_timeout(&MetadataMap::new()), None);
    }
}
