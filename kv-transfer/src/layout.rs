//! The KV layout descriptor: the shape of one worker's KV blocks.
//!
//! Two workers may exchange blocks only when their descriptors are equal:
//! a block is a run of raw bytes, and the receiver copies it into its cache
//! with no conversion, so any difference (a block size of 16 against 32, a
//! different head count or dtype) would be silent corruption. Every transport
//! exchanges descriptors before the first block and refuses a mismatch with a
//! [`TransferError::LayoutMismatch`] naming the field.
//!
//! The unit of transfer is one block of one layer: K and V, each
//! [`KvLayoutDescriptor::block_layer_bytes`] long, laid out
//! `[kv_head][slot][head_dim]` exactly as the engine stores it. A latent
//! layout ([`KvRows::Latent`], multi-head latent attention) has one row of
//! `head_dim` per token and no V: its V part is empty
//! ([`KvLayoutDescriptor::value_bytes`]).

use crate::TransferError;

/// The element type of the KV cache.
///
/// Codes on the wire: 0 = f32, 1 = bf16, 2 = f16. Codes 3 (int8) and 4 (fp8)
/// are reserved: quantised caches carry per-block scales, which change the
/// block's byte layout, so they will be added together with that layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvDtype {
    /// 32-bit IEEE float (what the engine stores today).
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
}

impl KvDtype {
    /// Bytes of one element.
    pub fn size_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 | KvDtype::F16 => 2,
        }
    }

    /// The name used in messages ("f32", "bf16", "f16").
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::F16 => "f16",
        }
    }

    /// The dtype [`Self::name`] names (how the gRPC layout message
    /// carries it).
    pub fn from_name(name: &str) -> Result<Self, TransferError> {
        [KvDtype::F32, KvDtype::Bf16, KvDtype::F16]
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| {
                TransferError::InvalidLayout(format!(
                    "unknown KV dtype {name:?} (known: f32, bf16, f16)"
                ))
            })
    }

    /// The wire code.
    pub fn code(self) -> u8 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::Bf16 => 1,
            KvDtype::F16 => 2,
        }
    }

    /// The dtype of a wire code.
    pub fn from_code(code: u8) -> Result<Self, TransferError> {
        match code {
            0 => Ok(KvDtype::F32),
            1 => Ok(KvDtype::Bf16),
            2 => Ok(KvDtype::F16),
            other => Err(TransferError::InvalidLayout(format!(
                "unknown KV dtype code {other} (known: 0 f32, 1 bf16, 2 f16)"
            ))),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a layout's rows are. Codes on the wire: 0 = per head, 1 = latent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvRows {
    /// K and V of each KV head, `head_dim` each per token.
    #[default]
    PerHead,
    /// One latent of `head_dim` per token (one "KV head"), no V.
    Latent,
}

impl KvRows {
    fn code(self) -> u8 {
        match self {
            KvRows::PerHead => 0,
            KvRows::Latent => 1,
        }
    }

    fn from_code(code: u8) -> Result<Self, TransferError> {
        match code {
            0 => Ok(KvRows::PerHead),
            1 => Ok(KvRows::Latent),
            other => Err(TransferError::InvalidLayout(format!(
                "unknown KV row kind {other} (known: 0 per head, 1 latent)"
            ))),
        }
    }

    /// The name used in messages.
    pub fn name(self) -> &'static str {
        match self {
            KvRows::PerHead => "per-head K and V",
            KvRows::Latent => "latent",
        }
    }
}

/// The shape of a worker's KV cache as far as a transfer is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayoutDescriptor {
    /// Transformer layers (each has its own K and V pools).
    pub num_layers: u32,
    /// KV heads per layer.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Element type.
    pub dtype: KvDtype,
    /// Positions a sliding-window layer attends to (0: no layer slides).
    /// Such layers keep only their window's blocks, grouped as the engine's
    /// `KvGroups` say, so both ends must agree on which layers slide.
    pub sliding_window: u32,
    /// Bit `l` set: layer `l` slides.
    pub windowed_layers: u128,
    /// Per-head K and V, or one latent per token.
    pub rows: KvRows,
}

/// The largest K (or V) payload of one block of one layer that any transport
/// accepts: 16 MiB. Real layouts are far below (8 heads × 16 tokens × 128 ×
/// 4 bytes = 64 KiB); the cap keeps a frame's size bounded.
pub const MAX_BLOCK_LAYER_BYTES: u64 = 16 << 20;

impl KvLayoutDescriptor {
    /// Bytes of encoded descriptor on the wire.
    pub const ENCODED_LEN: usize = 40;

    /// Bytes of K of one block in one layer (and of V, per head):
    /// `num_kv_heads × block_size × head_dim × dtype bytes`.
    pub fn block_layer_bytes(&self) -> usize {
        self.num_kv_heads as usize
            * self.block_size as usize
            * self.head_dim as usize
            * self.dtype.size_bytes()
    }

    /// Bytes of V of one block in one layer: as K's per head, none for a
    /// latent.
    pub fn value_bytes(&self) -> usize {
        match self.rows {
            KvRows::PerHead => self.block_layer_bytes(),
            KvRows::Latent => 0,
        }
    }

    /// Bytes one block of one layer moves: K and V.
    pub fn block_payload_bytes(&self) -> usize {
        self.block_layer_bytes() + self.value_bytes()
    }

    /// Checks the descriptor describes a real, transferable layout: every
    /// dimension non-zero and one block-layer at most
    /// [`MAX_BLOCK_LAYER_BYTES`].
    pub fn validate(&self) -> Result<(), TransferError> {
        for (name, value) in [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("block_size", self.block_size),
        ] {
            if value == 0 {
                return Err(TransferError::InvalidLayout(format!(
                    "{name} must be at least 1"
                )));
            }
        }
        let bytes = u64::from(self.num_kv_heads)
            * u64::from(self.block_size)
            * u64::from(self.head_dim)
            * self.dtype.size_bytes() as u64;
        if bytes > MAX_BLOCK_LAYER_BYTES {
            return Err(TransferError::InvalidLayout(format!(
                "one block of one layer is {bytes} bytes of K; the most a transfer carries is \
                 {MAX_BLOCK_LAYER_BYTES}"
            )));
        }
        Ok(())
    }

    /// `Ok` when blocks of `peer` can be copied byte for byte into blocks of
    /// `self`; otherwise a [`TransferError::LayoutMismatch`] naming the first
    /// field that differs, with this side's value and the peer's
    /// (e.g. "block_size 16 here, 32 at the peer").
    pub fn check_compatible(&self, peer: &KvLayoutDescriptor) -> Result<(), TransferError> {
        let numeric = [
            ("num_layers", self.num_layers, peer.num_layers),
            ("num_kv_heads", self.num_kv_heads, peer.num_kv_heads),
            ("head_dim", self.head_dim, peer.head_dim),
            ("block_size", self.block_size, peer.block_size),
        ];
        for (field, here, there) in numeric {
            if here != there {
                return Err(TransferError::LayoutMismatch {
                    field,
                    here: here.to_string(),
                    peer: there.to_string(),
                });
            }
        }
        if (self.sliding_window, self.windowed_layers)
            != (peer.sliding_window, peer.windowed_layers)
        {
            let windows = |d: &Self| {
                format!(
                    "window {} on layers {:#x}",
                    d.sliding_window, d.windowed_layers
                )
            };
            return Err(TransferError::LayoutMismatch {
                field: "sliding window layers",
                here: windows(self),
                peer: windows(peer),
            });
        }
        if self.dtype != peer.dtype {
            return Err(TransferError::LayoutMismatch {
                field: "dtype",
                here: self.dtype.to_string(),
                peer: peer.dtype.to_string(),
            });
        }
        if self.rows != peer.rows {
            return Err(TransferError::LayoutMismatch {
                field: "rows",
                here: self.rows.name().to_string(),
                peer: peer.rows.name().to_string(),
            });
        }
        Ok(())
    }

    /// The compact wire form: four little-endian `u32`s (layers, kv heads,
    /// head dim, block size), the dtype code, the row kind's code, two zero
    /// bytes, the sliding window (`u32`) and the windowed-layer mask
    /// (`u128`), little-endian.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[0..4].copy_from_slice(&self.num_layers.to_le_bytes());
        out[4..8].copy_from_slice(&self.num_kv_heads.to_le_bytes());
        out[8..12].copy_from_slice(&self.head_dim.to_le_bytes());
        out[12..16].copy_from_slice(&self.block_size.to_le_bytes());
        out[16] = self.dtype.code();
        out[17] = self.rows.code();
        out[20..24].copy_from_slice(&self.sliding_window.to_le_bytes());
        out[24..40].copy_from_slice(&self.windowed_layers.to_le_bytes());
        out
    }

    /// Parses [`encode`](Self::encode)'s output; an unknown dtype or non-zero
    /// reserved bytes are errors.
    pub fn decode(bytes: &[u8; Self::ENCODED_LEN]) -> Result<Self, TransferError> {
        let word =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        if bytes[18..20] != [0, 0] {
            return Err(TransferError::InvalidLayout(
                "reserved bytes of the layout descriptor are not zero".into(),
            ));
        }
        let mut mask = [0u8; 16];
        mask.copy_from_slice(&bytes[24..40]);
        Ok(Self {
            num_layers: word(0),
            num_kv_heads: word(4),
            head_dim: word(8),
            block_size: word(12),
            dtype: KvDtype::from_code(bytes[16])?,
            sliding_window: word(20),
            windowed_layers: u128::from_le_bytes(mask),
            rows: KvRows::from_code(bytes[17])?,
        })
    }
}

impl std::fmt::Display for KvLayoutDescriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.rows {
            KvRows::PerHead => write!(
                f,
                "{} layers × {} kv heads × head_dim {} × block_size {} ({})",
                self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype
            )?,
            KvRows::Latent => write!(
                f,
                "{} layers × one latent of {} × block_size {} ({})",
                self.num_layers, self.head_dim, self.block_size, self.dtype
            )?,
        }
        if self.sliding_window > 0 {
            write!(
                f,
                ", window {} on {} layers",
                self.sliding_window,
                self.windowed_layers.count_ones()
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayoutDescriptor {
        KvLayoutDescriptor {
            rows: crate::KvRows::PerHead,
            num_layers: 12,
            num_kv_heads: 4,
            head_dim: 64,
            block_size: 16,
            dtype: KvDtype::F32,
            sliding_window: 0,
            windowed_layers: 0,
        }
    }

    #[test]
    fn block_layer_bytes_is_heads_slots_dim_dtype() {
        assert_eq!(layout().block_layer_bytes(), 4 * 16 * 64 * 4);
        let bf16 = KvLayoutDescriptor {
            dtype: KvDtype::Bf16,
            ..layout()
        };
        assert_eq!(bf16.block_layer_bytes(), 4 * 16 * 64 * 2);
    }

    #[test]
    fn encoding_round_trips() -> Result<(), TransferError> {
        for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::F16] {
            let l = KvLayoutDescriptor { dtype, ..layout() };
            assert_eq!(KvLayoutDescriptor::decode(&l.encode())?, l);
        }
        Ok(())
    }

    #[test]
    fn decode_rejects_unknown_dtype_and_reserved_bytes() {
        let mut bytes = layout().encode();
        bytes[16] = 9;
        let err = KvLayoutDescriptor::decode(&bytes)
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("dtype code 9")));
        let mut bytes = layout().encode();
        bytes[19] = 1;
        assert!(KvLayoutDescriptor::decode(&bytes).is_err());
        let mut bytes = layout().encode();
        bytes[17] = 7;
        assert!(KvLayoutDescriptor::decode(&bytes).is_err());
    }

    #[test]
    fn a_latent_layout_moves_one_row_per_token_and_no_v() -> Result<(), TransferError> {
        let latent = KvLayoutDescriptor {
            rows: KvRows::Latent,
            num_kv_heads: 1,
            head_dim: 576,
            ..layout()
        };
        assert_eq!(KvLayoutDescriptor::decode(&latent.encode())?, latent);
        assert_eq!(latent.block_layer_bytes(), 16 * 576 * 4);
        assert_eq!(latent.value_bytes(), 0);
        assert_eq!(latent.block_payload_bytes(), 16 * 576 * 4);
        assert_eq!(layout().block_payload_bytes(), 2 * 4 * 16 * 64 * 4);
        // One head of the same width, with a V, is refused by name.
        let per_head = KvLayoutDescriptor {
            rows: KvRows::PerHead,
            ..latent
        };
        let msg = latent
            .check_compatible(&per_head)
            .err()
            .map(|e| e.to_string());
        assert!(msg.is_some_and(|m| m.contains("rows latent here, per-head K and V at the peer")));
        Ok(())
    }

    #[test]
    fn mismatch_names_the_field_and_both_values() {
        let here = layout();
        let peer = KvLayoutDescriptor {
            block_size: 32,
            ..layout()
        };
        let msg = here.check_compatible(&peer).err().map(|e| e.to_string());
        assert_eq!(
            msg.as_deref(),
            Some("KV layout mismatch: block_size 16 here, 32 at the peer")
        );
        let peer = KvLayoutDescriptor {
            dtype: KvDtype::Bf16,
            ..layout()
        };
        let msg = here.check_compatible(&peer).err().map(|e| e.to_string());
        assert!(msg.is_some_and(|m| m.contains("dtype f32 here, bf16 at the peer")));
        assert!(here.check_compatible(&layout()).is_ok());
    }

    #[test]
    fn validate_rejects_zero_and_huge() {
        let zero = KvLayoutDescriptor {
            head_dim: 0,
            ..layout()
        };
        assert!(zero
            .validate()
            .err()
            .is_some_and(|e| e.to_string().contains("head_dim")));
        let huge = KvLayoutDescriptor {
            num_kv_heads: 1 << 20,
            ..layout()
        };
        assert!(huge.validate().is_err());
        assert!(layout().validate().is_ok());
    }
}
