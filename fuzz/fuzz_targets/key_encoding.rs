//! Key templating and encoding: never panics, and distinct values never make the same key.
#![no_main]

use dlock::key_template::{KeyBuilder, KeyTemplate, encode_component};
use libfuzzer_sys::fuzz_target;

fn two_part_key(a: &str, b: &str) -> String {
    let mut key = KeyBuilder::new();
    key.literal("t:").value(a).literal(":").value(b);
    key.finish()
}

fuzz_target!(|input: (String, String, String, String)| {
    let (a, b, c, d) = input;

    // Encoding is injective and leaves no separator or control character unencoded.
    let (ea, ec) = (encode_component(&a), encode_component(&c));
    assert_eq!(ea == ec, a == c, "encode_component({a:?}) vs ({c:?})");
    assert!(
        !ea.contains([':', '{', '}', '<', '>']) && !ea.contains(char::is_control),
        "{ea:?}"
    );

    // Two values in one key: distinct pairs make distinct keys.
    assert_eq!(
        two_part_key(&a, &b) == two_part_key(&c, &d),
        (&a, &b) == (&c, &d),
        "({a:?}, {b:?}) vs ({c:?}, {d:?})"
    );

    // Any template text parses or is refused with an error; a parsed one renders, and two
    // different values for its placeholders render different keys.
    if let Ok(template) = KeyTemplate::parse(&a) {
        let first = template.render(|_| Some(b.as_str()));
        let second = template.render(|_| Some(d.as_str()));
        if let (Ok(first), Ok(second)) = (first, second) {
            if template.placeholders().next().is_some() && b != d {
                assert_ne!(first, second, "template {a:?} with {b:?} and {d:?}");
            }
        }
    }
});
