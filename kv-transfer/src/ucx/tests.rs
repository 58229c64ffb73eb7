//! Unit tests of the UCX wire pieces that need no peer.

use super::*;

#[test]
fn offer_round_trips_and_rejects_bad_lengths() -> Result<(), TransferError> {
    let offer = Offer {
        conn: 7,
        region_addr: 0xdead_beef,
        slot_bytes: 64,
        slots: 9,
        worker: vec![1, 2, 3],
        rkey: vec![4, 5],
    };
    let frame = encode_offer(&offer);
    assert_eq!(frame[0], FRAME_OFFER);
    let back = decode_offer(&frame[protocol::FRAME_HEADER..])?;
    assert_eq!(
        (back.conn, back.region_addr, back.slot_bytes, back.slots),
        (7, 0xdead_beef, 64, 9)
    );
    assert_eq!((back.worker, back.rkey), (vec![1, 2, 3], vec![4, 5]));
    // Truncated, a lying length, an empty key.
    assert!(decode_offer(&frame[protocol::FRAME_HEADER..frame.len() - 1]).is_err());
    assert!(decode_offer(&[0; 8]).is_err());
    let mut no_key = frame[protocol::FRAME_HEADER..].to_vec();
    no_key[28..32].copy_from_slice(&0u32.to_le_bytes());
    assert!(decode_offer(&no_key).is_err());
    Ok(())
}

#[test]
fn am_header_carries_connection_and_sequence() {
    let h = am_header(3, 0x0102);
    assert_eq!(u64::from_le_bytes(h[..8].try_into().unwrap_or_default()), 3);
    assert_eq!(
        u64::from_le_bytes(h[8..].try_into().unwrap_or_default()),
        0x0102
    );
    assert_eq!(control_message(MSG_FINISH, TransferId(5)).len(), 9);
}
