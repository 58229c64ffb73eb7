//! The KV layout in its three spellings: the engine's, the transport's
//! handshake descriptor, and the worker protocol's message.

use tandem_engine::{KvLayout, SlidingLayers};
use tandem_kv_transfer::{KvDtype, KvLayoutDescriptor, KvRows, TransferError};
use tandem_proto::worker::v1 as wv1;

/// The transfer descriptor of an engine layout (the CPU engine stores f32).
pub fn descriptor(l: &KvLayout) -> KvLayoutDescriptor {
    KvLayoutDescriptor {
        rows: match l.rows {
            tandem_engine::KvRows::PerHead => KvRows::PerHead,
            tandem_engine::KvRows::Latent => KvRows::Latent,
        },
        num_layers: l.num_layers as u32,
        num_kv_heads: l.num_kv_heads as u32,
        head_dim: l.head_dim as u32,
        block_size: l.block_size as u32,
        dtype: KvDtype::F32,
        sliding_window: l.sliding.window as u32,
        windowed_layers: l.sliding.layers,
    }
}

/// The engine layout a descriptor describes (its dtype aside).
pub fn engine_layout(d: &KvLayoutDescriptor) -> KvLayout {
    KvLayout {
        rows: match d.rows {
            KvRows::PerHead => tandem_engine::KvRows::PerHead,
            KvRows::Latent => tandem_engine::KvRows::Latent,
        },
        num_layers: d.num_layers as usize,
        num_kv_heads: d.num_kv_heads as usize,
        head_dim: d.head_dim as usize,
        block_size: d.block_size as usize,
        sliding: SlidingLayers {
            window: d.sliding_window as usize,
            layers: d.windowed_layers,
        },
    }
}

/// The wire message of a descriptor.
pub fn to_proto(d: &KvLayoutDescriptor) -> wv1::KvLayout {
    wv1::KvLayout {
        num_layers: d.num_layers,
        num_kv_heads: d.num_kv_heads,
        head_dim: d.head_dim,
        block_size: d.block_size,
        dtype: d.dtype.name().to_string(),
        sliding_window: d.sliding_window,
        windowed_layers_lo: d.windowed_layers as u64,
        windowed_layers_hi: (d.windowed_layers >> 64) as u64,
        latent: d.rows == KvRows::Latent,
    }
}

/// The descriptor of a wire message; unknown dtypes are an error.
pub fn from_proto(p: &wv1::KvLayout) -> Result<KvLayoutDescriptor, TransferError> {
    let dtype = KvDtype::from_name(&p.dtype)?;
    Ok(KvLayoutDescriptor {
        rows: match p.latent {
            false => KvRows::PerHead,
            true => KvRows::Latent,
        },
        num_layers: p.num_layers,
        num_kv_heads: p.num_kv_heads,
        head_dim: p.head_dim,
        block_size: p.block_size,
        dtype,
        sliding_window: p.sliding_window,
        windowed_layers: u128::from(p.windowed_layers_hi) << 64 | u128::from(p.windowed_layers_lo),
    })
}
