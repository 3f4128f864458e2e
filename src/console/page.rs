//! The frame every page shares, and the small pieces of the pages' addresses: the deep link's
//! query (`domain`, repeated `descriptor`s of comma-separated `key=value` entries, `hits`).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::{html, Markup, DOCTYPE};

use crate::admin::DescriptorEntry;

/// The console's sections, for the navigation bar.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Section {
    Overview,
    Explain,
    Timeline,
    Bucket,
    Login,
}

/// A whole page: the navigation (and the logout button when a token guards the listener),
/// the title and `body`, answered with `status` (a page that reports bad input or an unknown
/// domain says so in its status too, as the JSON API does).
pub(crate) fn frame(section: Section, title: &str, logout: bool, status: StatusCode, body: Markup) -> Response {
    let nav = [
        (Section::Overview, "/", "Overview"),
        (Section::Explain, "/explain", "Explain"),
        (Section::Timeline, "/timeline", "Timeline"),
    ];
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { "Tollgate · " (title) }
                link rel="stylesheet" href=(super::assets::CSS_PATH);
                link rel="icon" href=(super::assets::ICON_PATH);
                script src=(super::assets::JS_PATH) defer {}
            }
            body {
                header {
                    span.brand { "Tollgate" }
                    @if section != Section::Login {
                        nav {
                            @for (s, href, label) in nav {
                                a href=(href) class=[(s == section).then_some("current")] { (label) }
                            }
                        }
                        @if logout {
                            form.action.logout data-post=(crate::admin::session::LOGOUT_PATH) data-body="{}" data-then="/login" {
                                button type="submit" { "Log out" }
                                output {}
                            }
                        }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    };
    html_response(status, markup)
}

/// Why a page could not show what it was asked: the status it answers with (as the JSON API
/// would), and the message it shows.
pub(crate) struct PageError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
}

impl PageError {
    /// `400`: the query is not what the page takes.
    pub(crate) fn bad_request(message: String) -> PageError {
        PageError {
            status: StatusCode::BAD_REQUEST,
            message,
        }
    }

    /// `404`: no such domain, rule or bucket.
    pub(crate) fn not_found(message: String) -> PageError {
        PageError {
            status: StatusCode::NOT_FOUND,
            message,
        }
    }

    /// The status a page answers with when it may show this error: its own, or `200`.
    pub(crate) fn status_of<T>(outcome: Option<&Result<T, PageError>>) -> StatusCode {
        match outcome {
            Some(Err(e)) => e.status,
            _ => StatusCode::OK,
        }
    }

    /// The error as the page shows it, in a card with `id`.
    pub(crate) fn card(&self, id: &str) -> Markup {
        html! { section.card { p.error id=(id) { (self.message) } } }
    }
}

impl From<crate::admin::ApiError> for PageError {
    fn from(e: crate::admin::ApiError) -> PageError {
        PageError {
            status: e.status(),
            message: e.message().to_owned(),
        }
    }
}

/// `markup` as a `text/html` answer with `status`.
pub(crate) fn html_response(status: StatusCode, markup: Markup) -> Response {
    let mut response = (status, markup.into_string()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    response
}

/// A refill rate as the rules files write it, in the first unit it is a whole number of
/// tokens in (`10/s`, `5/m` for `1/12s`, `100/m`, `3/h`), else per second rounded
/// (`0.3/s`); `none` for none. The same text whichever page shows the rate.
pub(crate) fn refill(per_second: f64) -> String {
    if per_second.is_nan() || per_second <= 0.0 {
        return "none".to_owned();
    }
    for (unit, seconds) in [("s", 1.0), ("m", 60.0), ("h", 3_600.0), ("d", 86_400.0)] {
        let per_unit = per_second * seconds;
        if (per_unit - per_unit.round()).abs() < 1e-6 * per_unit.max(1.0) && per_unit.round() >= 1.0 {
            return format!("{}/{unit}", per_unit.round());
        }
    }
    if per_second >= 0.001 {
        format!("{}/s", super::chart::number((per_second * 1000.0).round() / 1000.0))
    } else {
        format!("1 per {} s", super::chart::number((1.0 / per_second).round()))
    }
}

/// The pairs of a query string, decoded, in order.
pub(crate) fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// The first value of `name` in `pairs`, if given and not blank, as given: a descriptor
/// value's spaces are part of it (`api_key=demo ` is not `api_key=demo`).
pub(crate) fn first<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, v)| k == name && !v.trim().is_empty())
        .map(|(_, v)| v.as_str())
}

/// The descriptors of a query: each `descriptor` value, and each line of one (the form's
/// text area sends them one a line), as `key=value` entries separated by commas.
///
/// Errors name the descriptor and the entry that is not `key=value` with a key.
pub(crate) fn descriptors(pairs: &[(String, String)]) -> Result<Vec<Vec<DescriptorEntry>>, String> {
    let mut out = Vec::new();
    for (_, given) in pairs.iter().filter(|(k, _)| k == "descriptor") {
        // Only line ends are taken off: a value's own spaces are part of it.
        for line in given.lines().filter(|l| !l.trim().is_empty()) {
            out.push(descriptor(line)?);
        }
    }
    Ok(out)
}

/// One descriptor, `tenant=a,path=/x`: entries separated by commas, each a key, `=` and a
/// value; a backslash takes the next character as it is (`note=a\,b` is the value `a,b`).
pub(crate) fn descriptor(text: &str) -> Result<Vec<DescriptorEntry>, String> {
    let mut entries = Vec::new();
    let (mut key, mut value, mut in_value) = (String::new(), String::new(), false);
    let mut chars = text.chars();
    let finish = |key: &mut String, value: &mut String, in_value: &mut bool| {
        let entry = if *in_value && !key.trim().is_empty() {
            Ok(DescriptorEntry {
                key: key.trim().to_owned(),
                value: std::mem::take(value),
            })
        } else {
            Err(format!(
                "descriptor `{text}`: entry `{key}` is not key=value (entries are separated by commas; \\, is a comma in a value)"
            ))
        };
        key.clear();
        *in_value = false;
        entry
    };
    while let Some(c) = chars.next() {
        let c = match c {
            '\\' => chars.next().unwrap_or('\\'),
            ',' => {
                entries.push(finish(&mut key, &mut value, &mut in_value)?);
                continue;
            }
            '=' if !in_value => {
                in_value = true;
                continue;
            }
            c => c,
        };
        if in_value {
            value.push(c)
        } else {
            key.push(c)
        }
    }
    entries.push(finish(&mut key, &mut value, &mut in_value)?);
    Ok(entries)
}

/// A descriptor as the deep link writes it, read back by [`descriptor`]; `None` for one a
/// link cannot carry (a line break in a key or value).
pub(crate) fn descriptor_text(entries: &[DescriptorEntry]) -> Option<String> {
    let escape = |s: &str| s.replace('\\', "\\\\").replace(',', "\\,").replace('=', "\\=");
    let text = entries
        .iter()
        .map(|e| format!("{}={}", escape(&e.key), escape(&e.value)))
        .collect::<Vec<_>>()
        .join(",");
    (!text.contains(['\n', '\r'])).then_some(text)
}

/// `path?name=value&...`, each pair encoded.
pub(crate) fn link(path: &str, pairs: &[(&str, &str)]) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        query.append_pair(k, v);
    }
    format!("{path}?{}", query.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_link_descriptors() {
        let pairs = query_pairs(Some(
            "domain=edge&descriptor=api_key%3Ddemo&descriptor=tenant=a,path=/x%3Dy",
        ));
        let got = descriptors(&pairs).unwrap();
        assert_eq!(descriptor_text(&got[0]).unwrap(), "api_key=demo");
        assert_eq!(got[1].len(), 2);
        assert_eq!((got[1][1].key.as_str(), got[1][1].value.as_str()), ("path", "/x=y"));
        let spaced = descriptors(&query_pairs(Some("descriptor=api_key=victim%20"))).unwrap();
        assert_eq!(spaced[0][0].value, "victim ", "a value's spaces are its own");
        assert_eq!(
            first(&query_pairs(Some("descriptor=k=v%20")), "descriptor"),
            Some("k=v ")
        );
        let lines = query_pairs(Some("descriptor=a%3D1%0D%0Ab%3D2"));
        assert_eq!(descriptors(&lines).unwrap().len(), 2, "one a line");
        let err = descriptors(&query_pairs(Some("descriptor=a=1,oops"))).unwrap_err();
        assert!(err.contains("`oops`"), "{err}");
        assert!(descriptor("=x").is_err(), "a key is needed");
        assert!(descriptor("a=1,").is_err(), "an empty entry");
    }

    #[test]
    fn any_value_survives_the_deep_link() {
        for value in ["a,b", "x=y", r"back\slash", "", "é,=\\,"] {
            let entries = vec![DescriptorEntry {
                key: "k,=".into(),
                value: value.into(),
            }];
            let text = descriptor_text(&entries).unwrap();
            assert_eq!(descriptor(&text).unwrap(), entries, "{text}");
        }
        let broken = vec![DescriptorEntry {
            key: "k".into(),
            value: "a\nb".into(),
        }];
        assert_eq!(descriptor_text(&broken), None);
    }

    #[test]
    fn refills_read_as_the_rules_write_them() {
        assert_eq!(refill(10.0), "10/s");
        assert_eq!(refill(1.0 / 12.0), "5/m");
        assert_eq!(refill(100.0 / 60.0), "100/m");
        assert_eq!(refill(3.0 / 3600.0), "3/h");
        assert_eq!(refill(0.0), "none");
        assert_eq!(refill(1.0 / 7.0 / 86_400.0), "1 per 604800 s");
        assert_eq!(refill(0.3), "18/m");
        assert_eq!(refill(1.0 / 7.0), "0.143/s");
    }

    #[test]
    fn links_encode_their_values() {
        assert_eq!(
            link("/explain", &[("domain", "a b"), ("descriptor", "k=v&x")]),
            "/explain?domain=a+b&descriptor=k%3Dv%26x"
        );
    }
}
