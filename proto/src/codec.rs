//! The contracts' codec: prost, as tonic's default, but each stream's encode and decode
//! buffers start at 1 KiB instead of 8 KiB. A streaming run holds four of them (its RunStream
//! both ways, its Execute stream to the gateway both ways) for its whole life, and nearly
//! every message is far smaller than 8 KiB: under 1,000 concurrent runs the default buffers
//! were ~25 MiB of agent-svc's peak (issue 13). A larger message grows its buffer as before.

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Where a stream's buffers start; they grow to the largest message they carry.
const BUFFER_START: usize = 1024;
/// tonic's own default: how much decoded data a stream hands over before it yields.
const YIELD_THRESHOLD: usize = 32 * 1024;

#[derive(Debug, Clone)]
pub struct SmallBufferCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SmallBufferCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for SmallBufferCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::new(BUFFER_START, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(BufferSettings::new(BUFFER_START, YIELD_THRESHOLD))
    }
}
