//! Unit tests of the UCX wire pieces that need no peer.

use super::send::contiguous;
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
fn am_header_carries_connection_sequence_landing_and_body() {
    let h = rt::am_header(3, 0x0102, 7, 2, b"notice");
    assert_eq!(h.len(), rt::AM_HEADER + 6);
    assert_eq!(rt::parse_am_header(&h), Some((3, 0x0102, 7, 2)));
    assert_eq!(&h[rt::AM_HEADER..], b"notice");
    assert_eq!(rt::parse_am_header(&h[..rt::AM_HEADER - 1]), None);
    assert_eq!(control_message(MSG_FINISH, TransferId(5)).len(), 9);
}

#[test]
fn adjacent_buffers_merge_and_scattered_ones_are_staged_in_order() {
    let whole = Bytes::from((0u8..64).collect::<Vec<_>>());
    let adjacent = vec![whole.slice(0..16), whole.slice(16..40), whole.slice(40..64)];
    assert_eq!(rt::contiguous_ranges(&adjacent), vec![(whole.as_ptr(), 64)]);
    // Already contiguous: passed through, no copy.
    let kept = contiguous(adjacent);
    assert_eq!(kept.len(), 3);
    assert_eq!(kept[0].as_ptr(), whole.as_ptr());
    // Out of order or from separate allocations: one staged copy, in order.
    let scattered = vec![whole.slice(32..64), whole.slice(0..32)];
    assert_eq!(rt::contiguous_ranges(&scattered).len(), 2);
    let staged = contiguous(scattered);
    assert_eq!(staged.len(), 1);
    let expected: Vec<u8> = (32u8..64).chain(0..32).collect();
    assert_eq!(staged[0].as_ref(), expected.as_slice());
}

#[test]
fn puts_merge_only_where_source_and_destination_both_continue() {
    let whole = Bytes::from(vec![7u8; 64]);
    let put = |from: usize, to: usize, remote: u64| rt::Put {
        bytes: whole.slice(from..to),
        remote_addr: remote,
    };
    // K, V of two blocks into consecutive slots: one put.
    let one = rt::merged_puts(&[put(0, 16, 1000), put(16, 32, 1016), put(32, 64, 1032)]);
    assert_eq!(one, vec![(whole.as_ptr(), 64, 1000)]);
    // The ring wraps after the first block: two puts.
    let wrapped = rt::merged_puts(&[put(0, 16, 1000), put(16, 32, 1016), put(32, 64, 0)]);
    assert_eq!(wrapped.len(), 2);
    assert_eq!(wrapped[1], (whole[32..].as_ptr(), 32, 0));
    // Sources apart: no merge even into consecutive slots.
    let other = Bytes::from(vec![1u8; 16]);
    let apart = rt::merged_puts(&[
        put(0, 16, 1000),
        rt::Put {
            bytes: other,
            remote_addr: 1016,
        },
    ]);
    assert_eq!(apart.len(), 2);
}

#[test]
fn batches_are_whole_slots_within_the_notice_and_half_the_ring() {
    let slot = 64 << 10;
    // 4 MiB of 64 KiB slots in a 128-slot ring: 64.
    assert_eq!(batch_slots(4 << 20, slot, MAX_NOTICE_BLOCKS, 128), 64);
    // Never more than half the ring, nor than a notice names, nor fewer than one.
    assert_eq!(batch_slots(64 << 20, slot, MAX_NOTICE_BLOCKS, 128), 64);
    assert_eq!(batch_slots(64 << 20, slot, 16, 4096), 16);
    assert_eq!(batch_slots(1, slot, MAX_NOTICE_BLOCKS, 1), 1);
    let config = UcxConfig::new("t");
    assert_eq!(config.region_slots(slot), 128);
    assert_eq!(config.region_slots(config.region_bytes * 2), 1);
}
