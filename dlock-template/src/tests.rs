use std::collections::HashMap;

use super::*;

/// The segments, as `lit <text>` and `var <name>`, or the error.
fn parse(text: &str) -> Result<Vec<String>, ParseError> {
    Ok(Template::parse(text)?
        .segments()
        .iter()
        .map(|segment| match segment {
            Segment::Literal(text) => format!("lit {text}"),
            Segment::Placeholder(p) => format!("var {}", p.name()),
        })
        .collect())
}

fn render(template: &str, pairs: &[(&str, &str)]) -> String {
    let template = Template::parse(template).expect("template");
    let key = template.render(|p| {
        pairs
            .iter()
            .find(|(name, _)| *name == p.name())
            .map(|(_, value)| *value)
    });
    key.expect("a value for every placeholder")
}

#[test]
fn both_spellings_are_one_placeholder() {
    let expected = ["lit account:", "var account_id"];
    for text in [
        "account:{account_id}",
        "account:<account_id>",
        "account:< account_id >",
        "account:{ account_id }",
    ] {
        assert_eq!(parse(text).unwrap(), expected, "{text}");
    }
    assert_eq!(render("account:{id}", &[("id", "42")]), "account:42");
    assert_eq!(render("account:<id>", &[("id", "42")]), "account:42");
}

#[test]
fn doubled_delimiters_are_literal() {
    assert_eq!(parse("{{a}}<<b>>:{x}").unwrap(), ["lit {a}<b>:", "var x"]);
    assert_eq!(
        parse("a:{x}{{:{y}").unwrap(),
        ["lit a:", "var x", "lit {:", "var y"]
    );
    assert_eq!(render("{{{id}}}<<<id>>>", &[("id", "7")]), "{7}<7>");
    assert_eq!(
        render("transfer:{a}->>{b}", &[("a", "1"), ("b", "2")]),
        "transfer:1->2"
    );
}

#[test]
fn paths_indices_and_raw_identifiers() {
    assert_eq!(
        parse("t:{cmd.owner.0}:<self.name>:{r#type}:{0}:{ a . r#b . 12 }").unwrap(),
        [
            "lit t:",
            "var cmd.owner.0",
            "lit :",
            "var self.name",
            "lit :",
            "var type",
            "lit :",
            "var 0",
            "lit :",
            "var a.b.12",
        ]
    );
    let t = Template::parse("x:{ cmd . owner.0 }").unwrap();
    let p = t.placeholders().next().unwrap();
    assert_eq!(p.root(), "cmd");
    assert_eq!(p.members().collect::<Vec<_>>(), ["owner", "0"]);
    assert_eq!(p.path().count(), 3);
    assert_eq!(p.written(), "{ cmd . owner.0 }");
    assert_eq!(p.position(), 2);
}

#[test]
fn identifiers_are_unicode_as_in_rust() {
    assert_eq!(parse("k:{ключ}:{é_1}:{_x}").unwrap().len(), 6);
    assert_eq!(render("ü:{k}:鍵", &[("k", "ключ")]), "ü:ключ:鍵");
    for bad in ["{1x}", "{_}", "{a-b}", "{a b}", "{a·b}", "{a\u{301}}"] {
        assert!(
            matches!(Template::parse(bad), Err(ParseError::BadName { .. })),
            "{bad}"
        );
    }
    // The standard library's letters and digits only approximate Unicode's identifier
    // classes: `²` is a digit to `char::is_alphanumeric`, though not in a Rust identifier.
    // The attribute finds no parameter or field of that name and says so.
    assert_eq!(parse("{x²}").unwrap(), ["var x²"]);
}

#[test]
fn raw_identifiers_follow_rust() {
    assert_eq!(parse("{r#type}").unwrap(), ["var type"]);
    assert_eq!(parse("{r#fn.r#match}").unwrap(), ["var fn.match"]);
    for bad in [
        "{r#}",
        "{r#_}",
        "{r#self}",
        "{r#Self}",
        "{r#super}",
        "{r#crate}",
        "{r#1}",
    ] {
        assert!(
            matches!(Template::parse(bad), Err(ParseError::BadName { .. })),
            "{bad}"
        );
    }
}

#[test]
fn tuple_indices_are_decimal_u32s() {
    assert_eq!(parse("{0}:{1.2}:{4294967295}").unwrap().len(), 5);
    for bad in ["{00}", "{01}", "{4294967296}", "{+1}", "{0x1}", "{1_0}"] {
        assert!(
            matches!(Template::parse(bad), Err(ParseError::BadName { .. })),
            "{bad}"
        );
    }
}

#[test]
fn placeholders_need_a_separator() {
    assert_eq!(
        Template::parse("{a}{b}"),
        Err(ParseError::NoSeparator {
            position: 3,
            previous: "{a}".into(),
            written: "{b}".into(),
            between: String::new(),
        })
    );
    assert_eq!(
        Template::parse("{a}-<b>"),
        Err(ParseError::NoSeparator {
            position: 4,
            previous: "{a}".into(),
            written: "<b>".into(),
            between: "-".into(),
        })
    );
    assert!(Template::parse("{a}/x/{b}").is_err());
    assert!(Template::parse("{a}%{b}").is_err());
    for ok in [
        "{a}:{b}",
        "{a}<<{b}",
        "{a}}}{b}",
        "{a}>>{b}",
        "{a}{{{b}",
        "{a}\n{b}",
        "{a}\u{85}{b}",
        "{a}-:-{b}",
        "{a}->>{b}",
        "x{a}y",
    ] {
        assert!(Template::parse(ok).is_ok(), "{ok:?}");
    }
}

/// The separator rule is needed: without a separator between two placeholders, two distinct
/// pairs of values make the same key.
#[test]
fn without_a_separator_keys_collide() {
    for between in ["", "-", "/", "ab", "é", " ", "-/-"] {
        assert!(Template::parse(&format!("{{a}}{between}{{b}}")).is_err());
        let key = |a: &str, b: &str| {
            let mut key = KeyBuilder::new();
            key.value(a).literal(between).value(b);
            key.finish()
        };
        let (x, y) = (format!("x{between}"), format!("{between}y"));
        assert_eq!(key(&x, "y"), key("x", &y), "{between:?}");
    }
}

#[test]
fn malformed_templates() {
    let unclosed = |position, open| Err(ParseError::Unclosed { position, open });
    assert_eq!(Template::parse("a{b"), unclosed(1, '{'));
    assert_eq!(Template::parse("a<b"), unclosed(1, '<'));
    assert_eq!(Template::parse("account:{id"), unclosed(8, '{'));
    // `{a>` is an unclosed `{`, not a `{` closed by `>`.
    assert_eq!(Template::parse("a:{b>"), unclosed(2, '{'));
    let unopened = |position, close| Err(ParseError::Unopened { position, close });
    assert_eq!(Template::parse("a}b"), unopened(1, '}'));
    assert_eq!(Template::parse("x->y"), unopened(2, '>'));
    assert_eq!(Template::parse("é>"), unopened(2, '>'));
    assert_eq!(
        Template::parse("a:{}"),
        Err(ParseError::EmptyName {
            position: 2,
            written: "{}".into()
        })
    );
    assert_eq!(
        Template::parse("< >"),
        Err(ParseError::EmptyName {
            position: 0,
            written: "< >".into()
        })
    );
    assert_eq!(
        Template::parse("a:{ b c }"),
        Err(ParseError::BadName {
            position: 2,
            written: "{ b c }".into(),
            name: "b c".into()
        })
    );
    for bad in ["{b.}", "{.b}", "{a..b}", "{a.b.}", "{a<b}", "{a{b}"] {
        let err = Template::parse(bad).unwrap_err();
        assert!(
            matches!(err, ParseError::BadName { position: 0, .. }),
            "{bad}: {err:?}"
        );
    }
}

#[test]
fn error_messages_say_what_to_write() {
    let message = |text: &str| Template::parse(text).unwrap_err().to_string();
    assert_eq!(
        message("a:{b"),
        "unclosed `{` in the key template: close the placeholder with `}`, or write `{{` for \
         a literal `{`"
    );
    assert_eq!(
        message("a>"),
        "unmatched `>` in the key template; write `>>` for a literal `>`"
    );
    assert!(message("a:{}").starts_with("empty placeholder `{}`: name a parameter or field"));
    assert!(message("a:{b c}").starts_with("invalid placeholder `{b c}`: "));
    assert!(message("{a}{b}").contains("`{a}` and `{b}` need a `:` between them: without one"));
    assert!(message("{a}-<b>").contains("`{a}` and `<b>` need a `:` between them: with only `-`"));
    assert_eq!(Template::parse("ab}").unwrap_err().position(), 2);
}

/// Every case the runtime parser (`KeyTemplate`) and the attribute's parser decided before
/// they shared this one, with the decision now.
#[test]
fn cases_the_two_former_parsers_decided() {
    // Both accepted, and still do.
    for ok in [
        "",
        "static",
        "account:{id}",
        "{a}:{ b }",
        "{cmd.account_id}",
        "t:{cmd.owner.0}",
        "{0}",
        "{{literal}}:<id>:{tenant.id}",
        "{a}->>{b}",
    ] {
        assert!(Template::parse(ok).is_ok(), "{ok:?}");
    }
    // Both refused, and still do.
    for bad in [
        "a{b", "a<b", "a}", "a>", "{}", "{a b}", "{a}{b}", "{a}-{b}", "{a>", "{b.}", "{_}x",
    ] {
        assert!(Template::parse(bad).is_err(), "{bad:?}");
    }
    // The runtime parser took any ASCII letters, digits, `_` and `.`; these are not paths
    // of Rust identifiers and indices, and the attribute refused them.
    for bad in ["{1x}", "{_}", "{a..b}", "{.a}", "{a.}", "{9.}"] {
        assert!(Template::parse(bad).is_err(), "{bad:?}");
    }
    // Leading zeros: both took `{00}` (the attribute then found no field `00`).
    assert!(Template::parse("{00}").is_err());
    // The attribute took Unicode identifiers, raw identifiers and spaces around `.`; the
    // runtime parser refused them.
    assert_eq!(parse("{ключ}").unwrap(), ["var ключ"]);
    assert_eq!(parse("{r#type}").unwrap(), ["var type"]);
    assert_eq!(parse("{a . b}").unwrap(), ["var a.b"]);
}

#[test]
fn encodes_structure_and_control_characters() {
    assert_eq!(
        encode_component("a:b%c{d}<e>\n\u{7f}\u{85}é鍵 /"),
        "a%3Ab%25c%7Bd%7D%3Ce%3E%0A%7F%C2%85é鍵 /"
    );
    assert_eq!(encode_component(":%{}<>"), "%3A%25%7B%7D%3C%3E");
    assert_eq!(encode_component("\0\t\r\n\u{7f}"), "%00%09%0D%0A%7F");
    assert_eq!(encode_component("\u{9f}"), "%C2%9F");
    assert_eq!(encode_component("ok/ok?x=1&y"), "ok/ok?x=1&y");
    // An already encoded value is encoded again, so it stays distinct from its decoding.
    assert_eq!(encode_component("%3A"), "%253A");
    assert_eq!(encode_component(""), "");
}

#[test]
fn encoding_keeps_plain_values_borrowed() {
    assert!(matches!(encode_component("plain-42_ü"), Cow::Borrowed(_)));
    assert!(matches!(encode_component(""), Cow::Borrowed(_)));
    assert!(matches!(encode_component("a:b"), Cow::Owned(_)));
}

#[test]
fn builder_keeps_literals_and_encodes_values() {
    let mut a = KeyBuilder::with_capacity(16);
    a.literal("t:").value("1:2").literal(":").value("3");
    let mut b = KeyBuilder::new();
    b.literal("t:").value("1").literal(":").value("2:3");
    assert_eq!(a.clone().finish(), "t:1%3A2:3");
    assert_ne!(a.finish(), b.finish());
    let mut negative = KeyBuilder::new();
    negative.value(&-7i64);
    assert_eq!(negative.finish(), "-7");
}

#[test]
fn render_reports_the_first_missing_placeholder() {
    let t = Template::parse("a:{x}:{y}").unwrap();
    let missing = t.render(|p| (p.name() == "x").then_some("1")).unwrap_err();
    assert_eq!((missing.name(), missing.position()), ("y", 6));
    assert_eq!(t.capacity_hint(), 2 + 8 + 1 + 8);
    assert_eq!("a:{x}".parse::<Template>().unwrap().segments().len(), 2);
}

/// Values that stress the encoding: separators, `%` and what it encodes to, controls.
const TRICKY: [&str; 16] = [
    "", "x", ":", "x:", ":x", "%", "%3A", "3A", "-", "x-", "{", "}}", "<", ">", "\n", "é",
];

#[test]
fn distinct_pairs_give_distinct_keys() {
    let mut seen = HashMap::new();
    for a in TRICKY {
        for b in TRICKY {
            let key = render("{a}:{b}", &[("a", a), ("b", b)]);
            if let Some(earlier) = seen.insert(key.clone(), (a, b)) {
                panic!("{earlier:?} and {:?} collided on {key:?}", (a, b));
            }
        }
    }
}

/// A small deterministic generator (xorshift64*), so the property tests need no dependency
/// and fail the same way on every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32;
        usize::try_from(x).unwrap_or(0) % n
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// Template text from well-formed and malformed pieces.
fn random_template(rng: &mut Rng) -> String {
    const PIECES: [&str; 24] = [
        "{a}", "<b>", "{c}", "{ a }", "{a.0}", "{r#c}", ":", ":", "-", "/", "%", "x", "é", " ",
        "\n", "{{", "}}", "<<", ">>", "{", "}", ">", "{}", "{1x}",
    ];
    let len = rng.below(7);
    (0..len).map(|_| rng.pick(&PIECES)).collect()
}

/// Any template text parses or is refused without panicking; what parses is consistent
/// with the text and keeps the separator rule.
#[test]
fn random_templates_parse_consistently() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let (mut parsed, mut refused) = (0, 0);
    for _ in 0..20_000 {
        let text = random_template(&mut rng);
        let template = match Template::parse(&text) {
            Ok(template) => template,
            Err(err) => {
                assert!(text.is_char_boundary(err.position()), "{text:?}: {err:?}");
                assert!(matches!(
                    text[err.position()..].chars().next(),
                    Some('{' | '}' | '<' | '>')
                ));
                refused += 1;
                continue;
            }
        };
        parsed += 1;
        let mut previous_was_placeholder = false;
        for pair in template.segments().windows(2) {
            if let [Segment::Literal(a), Segment::Literal(b)] = pair {
                panic!("{text:?}: adjacent literals {a:?} {b:?}");
            }
        }
        for segment in template.segments() {
            match segment {
                Segment::Literal(text) => assert!(!text.is_empty()),
                Segment::Placeholder(p) => {
                    assert_eq!(
                        &text[p.position()..p.position() + p.written().len()],
                        p.written()
                    );
                    assert!(!previous_was_placeholder, "{text:?}");
                }
            }
            previous_was_placeholder = matches!(segment, Segment::Placeholder(_));
        }
        let placeholders: Vec<_> = template.segments().iter().collect();
        for (i, segment) in placeholders.iter().enumerate() {
            if let (
                Segment::Literal(between),
                Some(Segment::Placeholder(_)),
                Some(Segment::Placeholder(_)),
            ) = (
                segment,
                i.checked_sub(1).map(|j| placeholders[j]),
                placeholders.get(i + 1),
            ) {
                assert!(between.contains(is_separator), "{text:?}");
            }
        }
    }
    assert!(
        parsed > 2_000 && refused > 2_000,
        "{parsed} parsed, {refused} refused"
    );
}

/// Injectivity: for templates that parse, every assignment of values to their names makes
/// its own key. Exhaustive over [`TRICKY`] for up to three names.
#[test]
fn distinct_values_give_distinct_keys_in_random_templates() {
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    let mut checked = 0;
    while checked < 150 {
        let text = random_template(&mut rng);
        let Ok(template) = Template::parse(&text) else {
            continue;
        };
        let mut names: Vec<&str> = template.placeholders().map(Placeholder::name).collect();
        names.sort_unstable();
        names.dedup();
        if names.is_empty() {
            continue;
        }
        checked += 1;
        let combinations = TRICKY.len().pow(u32::try_from(names.len()).unwrap());
        let mut seen: HashMap<String, usize> = HashMap::with_capacity(combinations);
        for combination in 0..combinations {
            let value = |name: &str| {
                let place = names.iter().position(|n| *n == name)?;
                let digit = combination / TRICKY.len().pow(u32::try_from(place).ok()?);
                Some(TRICKY[digit % TRICKY.len()])
            };
            let key = template
                .render(|p| value(p.name()))
                .expect("every name has a value");
            if let Some(earlier) = seen.insert(key.clone(), combination) {
                panic!("{text:?}: assignments {earlier} and {combination} both make {key:?}");
            }
        }
    }
}

/// The same over random values and random pairs of assignments (which rarely collide by
/// chance, so this mostly checks that equal assignments give equal keys).
#[test]
fn keys_are_equal_exactly_when_values_are() {
    const CHARS: [&str; 12] = ["x", ":", "%", "3", "A", "{", "}", "<", ">", "-", "\n", "é"];
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    let value = |rng: &mut Rng| -> String { (0..rng.below(4)).map(|_| rng.pick(&CHARS)).collect() };
    for _ in 0..20_000 {
        let text = random_template(&mut rng);
        let Ok(template) = Template::parse(&text) else {
            continue;
        };
        let first: HashMap<&str, String> = ["a", "b", "c", "a.0"]
            .into_iter()
            .map(|n| (n, value(&mut rng)))
            .collect();
        let mut second = first.clone();
        if rng.below(2) == 0 {
            let name = rng.pick(&["a", "b", "c", "a.0"]);
            second.insert(name, value(&mut rng));
        }
        let key = |values: &HashMap<&str, String>| {
            template
                .render(|p| values.get(p.name()))
                .expect("a value for every name")
        };
        let used = |values: &HashMap<&str, String>| {
            template
                .placeholders()
                .map(|p| values[p.name()].clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            key(&first) == key(&second),
            used(&first) == used(&second),
            "{text:?}"
        );
    }
}
