"""Where an error starts: teacher-forced isolation and the verdicts that combine it with the chained run."""
