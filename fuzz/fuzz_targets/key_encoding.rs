//! Key templating and encoding, as `dlock-template` defines them for the library, the
//! attribute and the axum layer: never panics, and distinct values never make the same key.
#![no_main]

use dlock_template::{KeyBuilder, Template, encode_component, is_separator};
use libfuzzer_sys::fuzz_target;

fn two_part_key(a: &str, b: &str) -> String {
    let mut key = KeyBuilder::new();
    key.literal("t:").value(a).literal(":").value(b);
    key.finish()
}

/// The value of `name` in an assignment: the i-th name takes the i-th value, or "" past its
/// end.
fn value_of<'v>(names: &[&str], values: &'v [String], name: &str) -> Option<&'v str> {
    let i = names.iter().position(|n| *n == name)?;
    Some(values.get(i).map_or("", String::as_str))
}

/// Four texts (templates and values) and two assignments of values to a template's names.
type Input = (String, String, String, String, Vec<String>, Vec<String>);

fuzz_target!(|input: Input| {
    let (a, b, c, d, first, second) = input;

    // Encoding is injective and leaves no separator or control character unencoded.
    let (ea, ec) = (encode_component(&a), encode_component(&c));
    assert_eq!(ea == ec, a == c, "encode_component({a:?}) vs ({c:?})");
    assert!(!ea.contains(is_separator), "{ea:?}");

    // Two values in one key: distinct pairs make distinct keys.
    assert_eq!(
        two_part_key(&a, &b) == two_part_key(&c, &d),
        (&a, &b) == (&c, &d),
        "({a:?}, {b:?}) vs ({c:?}, {d:?})"
    );

    // Any template text parses or is refused with an error about a delimiter; a parsed one
    // renders, and two assignments of values to its names make the same key exactly when
    // they give every placeholder the same value.
    let template = match Template::parse(&a) {
        Ok(template) => template,
        Err(err) => {
            let at = err.position();
            assert!(
                a.is_char_boundary(at) && a[at..].starts_with(['{', '}', '<', '>']),
                "{a:?}: {err:?}"
            );
            return;
        }
    };
    let mut names: Vec<&str> = template.placeholders().map(|p| p.name()).collect();
    names.sort_unstable();
    names.dedup();
    let first_key = template.render(|p| value_of(&names, &first, p.name()));
    let second_key = template.render(|p| value_of(&names, &second, p.name()));
    let (Ok(first_key), Ok(second_key)) = (first_key, second_key) else {
        panic!("{a:?}: every name has a value");
    };
    let same_values = names
        .iter()
        .all(|n| value_of(&names, &first, n) == value_of(&names, &second, n));
    assert_eq!(
        first_key == second_key,
        same_values,
        "template {a:?} with {first:?} and {second:?}"
    );
});
