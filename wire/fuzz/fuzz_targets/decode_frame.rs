//! `cargo fuzz run decode_frame` (from `wire/`): the frame decoder must never panic, and whatever
//! it accepts must re-encode to a frame that decodes to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use specinfer_wire::{decode_frame, encode_frame, frame_len, Limits, FRAME_HEADER_BYTES};

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    if data.len() >= FRAME_HEADER_BYTES {
        let _ = frame_len(data[..FRAME_HEADER_BYTES].try_into().unwrap(), &limits);
    }
    if let Ok(msg) = decode_frame(data, &limits) {
        let frame = encode_frame(&msg);
        assert_eq!(
            decode_frame(&frame[FRAME_HEADER_BYTES..], &limits).unwrap(),
            msg
        );
    }
});
