"""A class's submissions as the platforms export them: Gradescope, GitHub Classroom, a plain folder.

Each fixture is laid out as the platform writes it. Gradescope's "Export Submissions" zip:

    assignment_4242_export/submission_metadata.yml    submission_<id>: {:submitters: [{:name:, :sid:, :email:}], ...}
    assignment_4242_export/submission_<id>/<the files the learner uploaded>

GitHub Classroom (`gh classroom clone student-repos`): `<title>-submissions/<assignment>-<login>/`, each a
git repository. A layout that is not understood fails loudly (exit 2, one line), never a class of zeros.
"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
from test_gradebook import cli

from msglab.catalog import all_labs, find_lab
from msglab.classroom.submissions import Person, SubmissionsError, read_submissions

# As Gradescope writes it (Ruby's YAML: symbol keys, a quoted sid, a timestamp, a null score).
METADATA = """\
submission_91817:
  :submitters:
  - :name: Ann Lee
    :sid: '1001'
    :email: ann@example.edu
  :created_at: 2026-11-30 23:41:07.123456000 -08:00
  :score:
  :status: processed
submission_91820:
  :submitters:
  - :name: Bo Chen
    :sid: '1002'
    :email: bo@example.edu
  - :name: Cy Diaz
    :sid: '1003'
    :email: cy@example.edu
  :created_at: 2026-12-01 08:02:44.000000000 -08:00
  :score: 7.0
  :status: processed
"""


def lab_files() -> dict[str, bytes]:
    one = find_lab("01")
    return {
        f"submission_91817/{one.file}": b"# ann's orders\n",
        f"submission_91820/{one.name}/{one.file}": b"# bo and cy's orders\n",
    }


def gradescope_zip(path: Path, metadata: str = METADATA, files: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("assignment_4242_export/submission_metadata.yml", metadata)
        for name, content in (lab_files() if files is None else files).items():
            zf.writestr(f"assignment_4242_export/{name}", content)
    return path


def test_gradescopes_export_maps_each_submission_to_its_submitters(tmp_path: Path) -> None:
    one = find_lab("01")
    for source in (gradescope_zip(tmp_path / "export.zip"), unzipped(tmp_path)):
        found = read_submissions(source)
        assert found.shape == "gradescope export"
        assert sorted(found.learners) == ["1001", "1002+1003"], "the sid, stable across resubmissions, not the folder"
        assert found.people["1001"] == [Person("Ann Lee", "1001", "ann@example.edu")]
        assert [p.name for p in found.people["1002+1003"]] == ["Bo Chen", "Cy Diaz"]
        assert found.find("1001", one, all_labs()).content == b"# ann's orders\n"
        assert found.find("1002+1003", one, all_labs()).content == b"# bo and cy's orders\n"


def unzipped(tmp_path: Path) -> Path:
    """The same export unzipped by the instructor: a folder holding assignment_4242_export/."""
    folder = tmp_path / "unzipped"
    with zipfile.ZipFile(gradescope_zip(tmp_path / "for-folder.zip")) as zf:
        zf.extractall(folder)
    return folder


@pytest.mark.parametrize(
    "metadata, files, said",
    [
        ("submission_91817: [unclosed\n", None, "cannot be read"),
        (METADATA.split("submission_91820")[0], None, "does not list the folder(s) submission_91820"),
        ("submission_91817:\n  :status: processed\n", {}, "not a submission with submitters"),
        ("submission_91817:\n  :submitters:\n  - :name: ''\n", {}, "no sid, email or name"),
    ],
)
def test_an_export_whose_metadata_does_not_match_fails_loudly(
    tmp_path: Path, metadata: str, files: dict[str, bytes] | None, said: str
) -> None:
    with pytest.raises(SubmissionsError, match=said.replace("(", r"\(").replace(")", r"\)")):
        read_submissions(gradescope_zip(tmp_path / "export.zip", metadata, files))


def test_github_classrooms_repositories_are_graded_under_the_learners_logins(tmp_path: Path) -> None:
    one = find_lab("01")
    folder = tmp_path / "msglab-take-home-submissions"
    for login in ("alice", "bob-k"):
        repo = folder / f"msglab-take-home-{login}"
        (repo / "labs" / one.name).mkdir(parents=True)
        (repo / "labs" / one.name / one.file).write_text(f"# {login}\n")
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    found = read_submissions(folder)
    assert (found.shape, sorted(found.learners)) == ("github classroom", ["alice", "bob-k"])
    assert found.find("bob-k", one, all_labs()).content == b"# bob-k\n"
    # Zipped (with their .git folders), the wrapper named otherwise: the common prefix is the assignment's.
    archive = tmp_path / "repos.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                zf.write(path, "download/" + path.relative_to(folder).as_posix())
    assert sorted(read_submissions(archive).learners) == ["alice", "bob-k"]
    assert sorted(read_submissions(archive, assignment="msglab-take-home").learners) == ["alice", "bob-k"]
    with pytest.raises(SubmissionsError, match="not every repository is named lab2-<login>"):
        read_submissions(folder, assignment="lab2")


def test_a_plain_folder_keeps_its_folder_names_as_ids(tmp_path: Path) -> None:
    one = find_lab("01")
    for learner in ("ann", "team-2"):
        (tmp_path / "class" / learner).mkdir(parents=True)
        (tmp_path / "class" / learner / one.file).write_text("# mine\n")
    found = read_submissions(tmp_path / "class")
    assert (found.shape, sorted(found.learners), found.people) == ("folders", ["ann", "team-2"], {})


def test_a_layout_that_is_not_understood_stops_with_one_clear_line(tmp_path: Path) -> None:
    # Gradescope's submission folders without their metadata: nobody can be told apart.
    loose = tmp_path / "loose"
    for name, content in lab_files().items():
        (loose / name).parent.mkdir(parents=True, exist_ok=True)
        (loose / name).write_bytes(content)
    # A folder of learners none of whom holds a lab file (a wrong folder given).
    (tmp_path / "wrong" / "alice" / "notes").mkdir(parents=True)
    (tmp_path / "wrong" / "alice" / "notes" / "todo.txt").write_text("nothing here")
    for source, said in ((loose, "without Gradescope's submission_metadata.yml"),
                         (tmp_path / "wrong", "layout not understood: no lab file")):  # fmt: skip
        done = cli(["grade", str(source), "--out", str(tmp_path / "out"), "--labs", "01"])
        assert done.returncode == 2, done.stdout + done.stderr
        lines = [line for line in done.stderr.splitlines() if line.startswith("msglab:")]
        assert len(lines) == 1 and said in lines[0], done.stderr
        assert "Traceback" not in done.stderr and not (tmp_path / "out" / "gradebook.csv").exists()


def test_a_class_from_gradescopes_export_gets_a_wide_gradebook_with_its_people_and_a_kept_salt(
    tmp_path: Path, no_nats_url: None
) -> None:
    import csv
    import io
    import json

    from msglab.classroom.gradebook import grade_class, seed_for

    two = find_lab("02")
    files = {f"submission_91817/{two.file}": two.source(solution=True).read_bytes(),
             f"submission_91820/{two.name}/{two.file}": two.source().read_bytes() + b"# done\n"}  # fmt: skip
    export = gradescope_zip(tmp_path / "export.zip", files=files)
    log = io.StringIO()  # not a terminal: progress comes as plain lines
    result = grade_class(export, labs=[two], out=tmp_path / "out", jobs=2, stream=log)
    assert not result.errors and len(result.salt) == 12, result.salt
    assert "grading: 2/2 verdicts in" in log.getvalue()
    with open(tmp_path / "out" / "grades.csv", newline="") as handle:
        wide = {row["learner"]: row for row in csv.DictReader(handle)}
    ann, group = wide["1001"], wide["1002+1003"]
    assert (ann["name"], ann["sid"], ann["email"]) == ("Ann Lee", "1001", "ann@example.edu")
    assert group["name"] == "Bo Chen; Cy Diaz" and group["email"] == "bo@example.edu; cy@example.edu"
    assert ann["lab 02"] == ann["total"] == ann["max"] and float(ann["total"]) > 0
    assert group["lab 02"] == group["total"] == "0", "the starter with a comment added earns nothing"
    saved = json.loads((tmp_path / "out" / "grading.json").read_text())
    assert saved["salt"] == result.salt and result.salt in (tmp_path / "out" / "summary.txt").read_text()
    rows = {row.learner: row for row in result.rows}
    assert rows["1001"].seed == seed_for("1001", two.name, result.salt)
    again = grade_class(export, labs=[two], out=tmp_path / "out", jobs=1, progress=False, learners=["1001"])
    regraded = {row.learner: row for row in again.rows}
    assert again.salt == result.salt and regraded["1001"].seed == rows["1001"].seed, "the same --out keeps its salt"
    # A subset regrade merges into the gradebook: the learner not graded again keeps their row.
    assert regraded["1002+1003"].result == rows["1002+1003"].result
    with open(tmp_path / "out" / "grades.csv", newline="") as handle:
        assert [row["learner"] for row in csv.DictReader(handle)] == ["1001", "1002+1003"]
    assert any("kept 1 earlier verdict" in note for note in again.notes)
    # Its summary's headline counts and times what it graded, not the merged gradebook (which said 2 verdicts).
    assert (tmp_path / "out" / "summary.txt").read_text().startswith("graded 1 learners x 1 labs: 1 verdicts in")
